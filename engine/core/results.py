"""StepResults: what a committed forward pass means for each request, as answers to the front end.

After the scheduler has recorded a step's tokens, each request that gained one has its logprobs
recorded, its grammar advanced, its text detokenized when a stream or a stop string needs it,
and its stop conditions checked; a finished request is released and answered in full, a
streaming one gets a partial answer.
"""

from __future__ import annotations

import time
from array import array
from typing import Callable, Optional

from engine.core.messages import ReqOutput
from engine.core.output import CoreView, req_output
from engine.core.routed_experts import RouteReader, route_slots
from engine.finish_reasons import abort_reason
from engine.runner.model_runner import ModelRunner
from engine.sampling.nucleus import replay_rows
from engine.scheduler.batch import BatchResult, ScheduleBatch
from engine.scheduler.finish import check_finished
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler
from engine.tokenizer import trims_stop_token


class StepResults:
    def __init__(self, core: CoreView, scheduler: Scheduler, runner: ModelRunner,
                 eos_token_ids: tuple[int, ...], context_len: int) -> None:
        self.core = core
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self._pending_routes: list[tuple[str, int, object]] = []  # (rid, first position, KV slots) released this step
        self._route_reader = RouteReader()

    def answer(self, batch: ScheduleBatch, result: BatchResult, grown: list[Req],
               then: Optional[ScheduleBatch] = None, sample_then: Optional[Callable[[], None]] = None
               ) -> list[ReqOutput]:
        """`grown`: the requests the step gave a token. `then`: the lookahead batch launched
        meanwhile, whose grammar mask is filled in the background once the matchers have these
        tokens. `sample_then`: launches `then`'s sampling; called as soon as what it reads is in
        (the tokens committed, the mask's fill posted) where the device, not the host, waits for
        the fill, so the device samples while the host answers; else after the answers."""
        constrained = [req for req in grown if req.grammar is not None]
        grammar_stops = self._advance_grammars(constrained)
        if then is not None and constrained:
            self.runner.prefetch_grammar_mask(then)
        early = sample_then is not None and (not constrained or self.runner.grammar_masks.gate is not None)
        if early:
            sample_then()
        record_logprobs(batch, result)
        record_kept_ids(batch, result)
        outputs: list[ReqOutput] = []
        for req in grown:
            req.note_weight_version(self.core.weight_version)
            outputs.extend(self._after_token(req, grammar_stops.get(id(req))))
        for req in _prompt_only(batch):  # max_new_tokens=0: prompt logprobs, no output
            req.finished_reason = {"type": "length", "length": 0}
            self._release(req)
            outputs.append(self.finish(req))
        self._attach_routes(outputs)
        if sample_then is not None and not early:
            sample_then()
        return outputs

    def _after_token(self, req: Req, grammar_stop: Optional[dict] = None) -> list[ReqOutput]:
        """grammar_stop: what the request's grammar said of this token (_advance_grammars)."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.detokenizer is not None and (req.stream or req.sampling_params.watches_text):
            _detokenize(req)  # text is needed now; otherwise once, at the end
        # a grammar's refusal first: a token it refused came from a row it left nothing in, even
        # where that token is a stop token (an unsatisfiable grammar's "stop" would hide why)
        refused = grammar_stop if grammar_stop is not None and grammar_stop.get("type") == "abort" else None
        reason = refused or check_finished(req, self.eos_token_ids, self.context_len) or grammar_stop
        if reason is None:
            return [req_output(req, self.core, finished=False)] if req.stream else []
        req.finished_reason = reason
        self._release(req)
        return [self.finish(req)]

    def _release(self, req: Req) -> None:
        """Free what a finished request holds, noting its routed experts' slots first (the routes
        live at its KV slots; _attach_routes reads those of the whole step at once)."""
        if (req.return_routed_experts and req.req_pool_idx is not None
                and self.runner.kv_pool.routed_experts is not None):
            self._pending_routes.append((req.rid, req.routed_experts_start_len,
                                         route_slots(self.runner.req_to_token_pool.req_to_token, req)))
        self.scheduler.release(req)

    def _attach_routes(self, outputs: list[ReqOutput]) -> None:
        """The routes of the step's finished requests, read for them all at once (no sync per
        request), as SGLang's base64 strings."""
        if not self._pending_routes:
            return
        pending, self._pending_routes = self._pending_routes, []
        routes = self._route_reader.read(self.runner.kv_pool.routed_experts, [slots for _, _, slots in pending])
        by_rid = {rid: (start, ids) for (rid, start, _), ids in zip(pending, routes)}
        for out in outputs:
            if out.finished and out.rid in by_rid:
                meta = out.output["meta_info"]
                meta["routed_experts_start_len"], meta["routed_experts"] = by_rid[out.rid]

    def _advance_grammars(self, reqs: list[Req]) -> dict[int, Optional[dict]]:
        """Feed each request's committed token to its grammar, one call for the batch. By request
        id, for those it ends: a stop reason once its grammar has terminated (it accepted a stop
        token), an abort if it refused the token (only possible when nothing the grammar allows
        was left to sample)."""
        if not reqs:
            return {}
        tokens = [req.output_ids[-1] for req in reqs]
        accepted = self.runner.grammar_masks.accept([req.grammar for req in reqs], tokens)
        return {id(req): _grammar_verdict(req.grammar, token, ok)
                for req, token, ok in zip(reqs, tokens, accepted) if not ok or req.grammar.is_terminated()}

    def finish(self, req: Req) -> ReqOutput:
        """The final answer of a finished request, its text complete."""
        if req.detokenizer is not None and req.stop_text_len is None:
            _detokenize(req)
            if trims_stop_token(req.finished_reason, req.sampling_params.no_stop_trim):  # as SGLang's text
                req.detokenizer.drop_last()
            req.detokenizer.flush()
            req.text = req.detokenizer.text
        return req_output(req, self.core, finished=True)

    def error(self, req: Req, message: str) -> ReqOutput:
        """A final answer built without the detokenizer or recorder (either may be what failed)."""
        if req.finished_reason is None or req.finished_reason.get("type") != "abort":
            req.finished_reason = abort_reason(message)
        return req_output(req, self.core, finished=True)


def record_kept_ids(batch: ScheduleBatch, result: BatchResult) -> None:
    """custom_params.return_top_p_token_ids: each kept sample's kept set (a greedy row's: its token)."""
    rows = replay_rows(batch.reqs)
    if not rows:
        return
    kept = batch.samples_kept()
    for i in rows:
        req = batch.reqs[i]
        if kept[i]:
            greedy = req.sampling_params.is_greedy
            req.output_kept_ids.append(array("i", [result.next_token_ids[i]]) if greedy else result.kept_ids[i])


def record_logprobs(batch: ScheduleBatch, result: BatchResult) -> None:
    kept = batch.samples_kept()
    for i, req in enumerate(batch.reqs):
        if not req.return_logprob:
            continue
        if req.wants_input_logprobs:
            req.input_logprobs.extend(result.input_logprobs[i])
            if req.top_logprobs_num and result.input_top_logprobs:
                req.input_top_logprobs.extend(result.input_top_logprobs[i])
            if req.token_ids_logprob and result.input_token_ids_logprobs:
                req.input_token_ids_logprobs.extend(result.input_token_ids_logprobs[i])
            if not req.is_chunked:
                req.input_logprobs_done = True
        if kept[i]:
            req.output_logprobs.append(result.logprobs[i])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(result.top_logprobs[i])
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(result.token_ids_logprobs[i])


def _prompt_only(batch: ScheduleBatch) -> list[Req]:
    if batch.forward_mode.is_decode:
        return []
    return [r for r in batch.reqs if not r.finished and not r.is_chunked and r.sampling_params.max_new_tokens == 0]


def _detokenize(req: Req) -> None:
    new_ids = req.output_ids[req.detokenized_len :]
    if new_ids:
        req.text += req.detokenizer.add(new_ids)
        req.detokenized_len = len(req.output_ids)


def _grammar_verdict(grammar, token: int, accepted: bool) -> Optional[dict]:
    if not accepted:
        why = getattr(grammar, "refusal", None) or f"the grammar refused token {token}: no allowed token was left"
        return abort_reason(why)
    if grammar.is_terminated():
        return {"type": "stop", "matched": token}
    return None
