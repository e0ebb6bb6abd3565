"""build_output: a request's SGLang-shaped response dict {"text", "output_ids", "meta_info"};
req_output: the ReqOutput that carries it. A streamed request's answers carry each output
position's logprobs once (and its prompt's with the first): re-sending all so far at every token
cost O(tokens^2) here (300 tokens x 1024 top logprobs: minutes of core time); the front end
joins them (engine/api/streamed_logprobs.py). A stream's text holds back a tail that may begin a
stop string (`streamable_text`)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from engine.core.messages import ReqOutput
from engine.sampling.nucleus import nucleus_fields
from engine.scheduler.finish import first_stop_in_tail, stop_prefix_len
from engine.scheduler.request import Req


class CoreView(Protocol):
    """What an output reads of the EngineCore (which imports this module, so no import back)."""
    weight_version: str


def req_output(req: Req, core: CoreView, finished: bool) -> ReqOutput:
    since = req.streamed_logprobs if req.stream else 0
    output = build_output(req, core, since)
    if not finished:  # a stream's chunk: without the tail a stop string may yet take back
        output["text"] = streamable_text(req)
    out = ReqOutput(req.rid, finished, output, logprobs_from=since)
    if req.stream:
        req.streamed_logprobs = len(req.output_ids)
    return out


def streamable_text(req: Req) -> str:
    """The text a stream may send before the request ends: all of it but a tail that could still
    grow into a stop string (which the final text leaves out, unless no_stop_trim keeps it). Before
    min_new_tokens a whole stop string is not checked yet: once it is, one still in the searched
    tail ends the text there, so that is held too."""
    params, text = req.sampling_params, req.text
    if not params.stop or params.no_stop_trim:
        return text
    if req.stop_scan is None:
        req.stop_scan = [0] * len(params.stop)
    end = len(text) - stop_prefix_len(text, params.stop, req.stop_scan)
    if len(req.output_ids) < params.min_new_tokens:
        whole = first_stop_in_tail(text, params.stop)
        end = min(end, whole[0]) if whole is not None else end
    return text[:end]


def build_output(req: Req, core: CoreView, since: int = 0) -> dict[str, Any]:
    """since: the first output position whose logprobs it carries (prompt logprobs only with 0)."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason,
        "e2e_latency": time.perf_counter() - req.created_time,
        # the weights of the last output token (the current ones before any); per token: spans
        "weight_version": req.weight_spans[-1][0] if req.weight_spans else core.weight_version,
        "weight_versions": _weight_spans(req),
        "sampling_seed": req.seed,
        "num_retractions": req.num_retractions,
        "total_retractions": req.num_retractions,  # SGLang's name for the same count
    }
    if req.return_logprob:
        meta.update(_logprob_fields(req, since))
    if req.sampling_params.return_top_p_token_ids and req.finished_reason is not None:  # once, at the end
        meta.update(nucleus_fields(_kept_per_token(req)))
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}


def _kept_per_token(req: Req) -> list:
    """One kept set per output token, as slime checks: an answer built after a step failed between
    taking its token and recording the set gives that token itself (it was certainly kept)."""
    kept = req.output_kept_ids[: len(req.output_ids)]
    return kept + [[token] for token in req.output_ids[len(kept):]]


def _logprob_fields(req: Req, since: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"logprob_distribution": req.logprob_distribution,
                              **_output_logprobs(req, since)}
    if since == 0:
        fields.update(_input_logprobs(req))
    return fields


def _output_logprobs(req: Req, since: int) -> dict[str, Any]:
    ids = req.output_ids[since:]
    fields: dict[str, Any] = {
        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(req.output_logprobs[since:], ids)],
    }
    if req.top_logprobs_num:
        fields["output_top_logprobs"] = [
            [[lp, tok, None] for lp, tok in (entry or [])] for entry in req.output_top_logprobs[since:]
        ]
    if req.token_ids_logprob:  # SGLang: per position, [logprob, id, text] per requested id, in its order
        wanted = req.token_ids_logprob
        fields["output_token_ids_logprobs"] = [
            [[lp, tok, None] for lp, tok in zip(values, wanted)] for values in req.output_token_ids_logprobs[since:]
        ]
    return fields


def _input_logprobs(req: Req) -> dict[str, Any]:
    """SGLang's prompt lists: one entry per prompt token from logprob_start_len on, the first one's
    value null at any start (shared/reference/sglang-rl-api.md: a client written for SGLang that
    keeps entry 0 and skips nulls must get the same sum here); the default start (-1): empty lists."""
    start = req.logprob_start_len
    fields: dict[str, Any] = {"input_token_logprobs": []}
    if req.top_logprobs_num:
        fields["input_top_logprobs"] = []
    if req.token_ids_logprob:
        fields["input_token_ids_logprobs"] = []
    if start < 0:
        return fields
    # req's lists begin at prompt token max(start, 1) (token 0 has no logprob): entry 0 becomes null
    skip = 1 if start > 0 else 0
    ids = req.origin_input_ids[start:]
    values = [None] + list(req.input_logprobs)[skip:]
    fields["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(values, ids)]
    if req.top_logprobs_num:
        fields["input_top_logprobs"] = [None] + [[[lp, tok, None] for lp, tok in entry]
                                                 for entry in req.input_top_logprobs[skip:]]
    if req.token_ids_logprob:
        wanted = req.token_ids_logprob
        fields["input_token_ids_logprobs"] = [None] + [[[lp, tok, None] for lp, tok in zip(row, wanted)]
                                                       for row in req.input_token_ids_logprobs[skip:]]
    return fields


def _weight_spans(req: Req) -> list[dict[str, Any]]:
    """[{"version", "start", "end"}]: output tokens [start, end) came from that weight version."""
    starts = [start for _, start in req.weight_spans[1:]] + [len(req.output_ids)]
    return [{"version": v, "start": start, "end": end} for (v, start), end in zip(req.weight_spans, starts)]
