"""build_output: a request's SGLang-shaped response dict {"text", "output_ids", "meta_info"}."""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol

from engine.scheduler.request import Req


class CoreView(Protocol):
    """What an output reads of the EngineCore (which imports this module, so no import back)."""
    weight_version: str


def build_output(req: Req, core: CoreView) -> dict[str, Any]:
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
        meta.update(_logprob_fields(req, core))
    if req.routed_experts is not None:
        meta["routed_experts"] = req.routed_experts
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}


def _logprob_fields(req: Req, core: CoreView) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "logprob_distribution": req.logprob_distribution,
        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)],
    }
    if req.logprob_start_len >= 0:
        start = req.logprob_start_len
        values: list[Optional[float]] = ([None] if start == 0 else []) + list(req.input_logprobs)
        tokens = req.origin_input_ids[start:]
        fields["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(values, tokens)]
    if req.top_logprobs_num and req.logprob_start_len >= 0:  # SGLang: the first position has none
        tops = [[[lp, tok, None] for lp, tok in entry] for entry in req.input_top_logprobs]
        fields["input_top_logprobs"] = ([None] if req.logprob_start_len == 0 else []) + tops
    if req.top_logprobs_num:
        fields["output_top_logprobs"] = [
            [[lp, tok, None] for lp, tok in (entry or [])] for entry in req.output_top_logprobs
        ]
    if req.token_ids_logprob:  # SGLang: per position, [logprob, id, text] per requested id, in its order
        ids = req.token_ids_logprob
        if req.logprob_start_len >= 0:  # the first prompt position has none, as for input_top_logprobs
            rows = [[[lp, tok, None] for lp, tok in zip(values, ids)] for values in req.input_token_ids_logprobs]
            fields["input_token_ids_logprobs"] = ([None] if req.logprob_start_len == 0 else []) + rows
        fields["output_token_ids_logprobs"] = [
            [[lp, tok, None] for lp, tok in zip(values, ids)] for values in req.output_token_ids_logprobs
        ]
    return fields


def _weight_spans(req: Req) -> list[dict[str, Any]]:
    """[{"version", "start", "end"}]: output tokens [start, end) came from that weight version."""
    starts = [start for _, start in req.weight_spans[1:]] + [len(req.output_ids)]
    return [{"version": v, "start": start, "end": end} for (v, start), end in zip(req.weight_spans, starts)]
