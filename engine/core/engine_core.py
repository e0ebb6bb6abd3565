"""EngineCore: scheduler + model runner behind a narrow message interface.

The front end (Engine) sends ReqInput / AbortReq / FlushCacheReq messages through `handle` and
calls `step`, which returns ReqOutput messages. Nothing else crosses, so the core can later move
into its own process unchanged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from engine.config import ServerArgs
from engine.core.control import GenerationControl
from engine.core.messages import (AbortReq, CheckIntegrityReq, ContinueReq, CoreInfo, DestroyWeightsGroupReq,
                                  FlushCacheReq, GetWeightVersionReq, InitWeightsGroupReq, PauseReq, ReleaseMemoryReq,
                                  ReqInput, ReqOutput, ResumeMemoryReq, SetWeightVersionReq, StatsReq, StatsSnapshot,
                                  UpdateWeightsReq)
from engine.core.messages import GetWeightsByNameReq, WeightsCheckerReq, WeightsChecksumReq
from engine.core.messages import WeightsGroupStatusReq
from engine.core.output import build_output
from engine.core.setup import CoreParts, build_core_parts
from engine.core.weight_checker import WeightChecker
from engine.core.weight_queries import weights_by_name, weights_checksum
from engine.grammar.compile_queue import GrammarQueue
from engine.grammar.compiler import GrammarCompiler, grammar_spec
from engine.grammar.matcher import RequestGrammar
from engine.grammar.matcher_client import MatcherClient, grammar_backend_for
from engine.runner.pending_result import PendingResult
from engine.scheduler.batch import BatchResult, ScheduleBatch
from engine.scheduler.finish import check_finished
from engine.scheduler.request import Req

logger = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.005  # an idle loop's wait for a compile: messages are read again after it
CONTROL_MESSAGES = (PauseReq, ContinueReq, UpdateWeightsReq, SetWeightVersionReq, InitWeightsGroupReq,
                    DestroyWeightsGroupReq, ReleaseMemoryReq, ResumeMemoryReq, WeightsGroupStatusReq)
# messages that read the loaded weights on rank 0 (refused under TP and while they are released)
WEIGHT_READS = (GetWeightsByNameReq, WeightsChecksumReq, WeightsCheckerReq)


@dataclass
class CoreStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_lookahead_steps: int = 0  # decode steps launched before the previous step was read
    num_mixed_steps: int = 0  # prefill passes that carried decode rows (--enable-mixed-chunk)
    started: float = field(default_factory=time.perf_counter)


class EngineCore:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.parts: CoreParts = build_core_parts(server_args)
        self.scheduler = self.parts.scheduler
        self.runner = self.parts.runner
        self.tokenizer = self.parts.tokenizer
        self.weight_version = "default"
        self.paused = False  # pause_generation: no new forward passes until continue_generation
        self.control = GenerationControl(self)
        self.stats = CoreStats()
        # overlap scheduling: on by default on CUDA (SGLang's choice); the CPU gains nothing
        self.overlap = self.runner.device.type == "cuda" and not server_args.disable_overlap_schedule
        self._inflight: Optional[PendingResult] = None  # launched, result not read yet
        self._uncommitted: list[ScheduleBatch] = []  # launched, tokens not committed yet
        self._processing: Optional[ScheduleBatch] = None
        self.memory_released: set[str] = set()  # release_memory_occupation tags not yet resumed
        self.weight_checker = WeightChecker()  # /weights_checker's snapshot lives here
        # constrained requests wait here while their grammar compiles, off the loop
        self.grammars = GrammarQueue(lambda: GrammarCompiler(self.tokenizer, self.parts.vocab_size,
                                                             self.parts.eos_token_ids),
                                     self._grammar_backend(server_args))

    def _grammar_backend(self, args: ServerArgs) -> Callable[[Any, tuple[str, str]], Any]:
        """How a compiled grammar becomes a request's matcher: here (thread backend), or in the
        grammar process, which then also advances matchers and fills masks for the runner."""
        if grammar_backend_for(args.grammar_backend, self.runner.device) != "process":
            return lambda compiled, spec: RequestGrammar(compiled)
        client = MatcherClient(args.tokenizer_path or args.model_path, self.parts.vocab_size,
                               self.parts.eos_token_ids, self.runner.device)
        self.runner.use_grammar_backend(client, client.ring)
        if self.tokenizer is not None:
            client.warm()
        return lambda compiled, spec: client.new(*spec, compiled.tokenizer_info.stop_token_ids)

    # ---- messages ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> Any:
        if isinstance(msg, ReqInput):
            return self._add_request(msg)
        if isinstance(msg, AbortReq):
            return self._abort(msg)
        if isinstance(msg, CONTROL_MESSAGES):
            return self.control.handle(msg)
        if isinstance(msg, FlushCacheReq):
            return self.scheduler.flush_cache()
        if isinstance(msg, GetWeightVersionReq):
            return self.weight_version
        if isinstance(msg, StatsReq):
            return self.snapshot()
        if isinstance(msg, CheckIntegrityReq):
            return self.scheduler.check_integrity()
        if isinstance(msg, WEIGHT_READS) and self.runner.tp is not None:
            raise ValueError("get_weights_by_name, the weights checksum and weights_checker read one rank's "
                             "shards under tp_size > 1: not supported yet")
        if isinstance(msg, WEIGHT_READS) and "weights" in self.memory_released:
            raise ValueError("the weights are released (release_memory_occupation): resume them first")
        if isinstance(msg, GetWeightsByNameReq):
            return weights_by_name(self.runner.model, msg.name, msg.truncate_size)
        if isinstance(msg, WeightsChecksumReq):
            return weights_checksum(self.runner.model.named_parameters())
        if isinstance(msg, WeightsCheckerReq):
            return self._check_weights(msg)
        raise TypeError(f"unknown message type {type(msg).__name__}")

    def _check_weights(self, msg: WeightsCheckerReq) -> dict:
        resetting = msg.action == "reset_tensors"
        if resetting and self.scheduler.num_holding_kv():
            raise ValueError("reset_tensors while requests hold KV would finish them on random weights: "
                             "pause generation or let them finish first")
        result = self.weight_checker.run(self.runner.model, msg.action, msg.skip_tensor_list, msg.allow_quant_error)
        if resetting:  # cached prefixes were computed with the old weights
            self.scheduler.flush_cache()
        return result

    def shutdown(self) -> None:
        """At the end of the core loop: the other tensor-parallel ranks' processes stop too."""
        self.grammars.shutdown()
        self.runner.shutdown()

    def info(self) -> CoreInfo:
        p, args = self.parts, self.server_args
        return CoreInfo(
            model_path=args.model_path, tokenizer_path=args.tokenizer_path or args.model_path,
            vocab_size=p.vocab_size, context_len=p.context_len, eos_token_ids=p.eos_token_ids,
            device=str(self.runner.device), dtype=str(self.runner.config.dtype).replace("torch.", ""),
            attention_backend=self.runner.config.attention_backend,
            max_total_num_tokens=p.memory.max_total_num_tokens, chunked_prefill_size=p.memory.chunked_prefill_size,
            max_running_requests=p.memory.max_running_requests, available_gb=p.memory.available_gb)

    def snapshot(self) -> StatsSnapshot:
        st, sched = self.stats, self.scheduler
        return StatsSnapshot(
            num_steps=st.num_steps, num_prefill_tokens=st.num_prefill_tokens, num_cached_tokens=st.num_cached_tokens,
            num_generated_tokens=st.num_generated_tokens, num_lookahead_steps=st.num_lookahead_steps,
            num_mixed_steps=st.num_mixed_steps, num_retractions=sched.num_retractions,
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting) + len(self.grammars.waiting),
            new_token_ratio=float(sched.new_token_ratio),
            kv_tokens_used=sched.allocator.size - sched.allocator.available_size(),
            kv_tokens_total=sched.allocator.size, num_weight_updates=self.control.num_updates,
            weight_update_seconds=self.control.update_seconds, paused=self.paused,
            memory_released=tuple(sorted(self.memory_released)), weight_version=self.weight_version,
            uptime_s=time.perf_counter() - st.started)

    def _add_request(self, msg: ReqInput) -> list[ReqOutput]:
        req = Req.from_input(msg)
        if self.tokenizer is not None and msg.core_detokenizes:  # else the front end decodes the final ids
            req.detokenizer = self.parts.make_detokenizer(req)
        spec = grammar_spec(req.sampling_params)  # compiled again here: compiled grammars do not pickle
        if spec is not None:
            req.grammar = self.grammars.submit(req, spec)
            if req.grammar is None:  # compiling: _admit_compiled queues it once its grammar is in
                return []
        self.scheduler.add_request(req)
        return []

    def _admit_compiled(self) -> list[ReqOutput]:
        """Queue the requests whose grammar compiled; a grammar that failed (the front end checked
        it already: only a core without tokenizer or xgrammar) fails its request."""
        outputs = []
        for req, grammar, error in self.grammars.pop_ready():
            if error is not None:
                outputs.append(self._error_output(req, error))
            else:
                req.grammar = grammar
                self.scheduler.add_request(req)
        return outputs

    def _abort(self, msg: AbortReq) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        rids = [msg.rid] if msg.rid is not None else self._all_rids()
        for rid in rids:
            req = self.grammars.remove(rid)
            if req is not None:  # still compiling its grammar: it never reached the scheduler
                req.finished_reason = {"type": "abort", "message": msg.message}
            else:
                req = self.scheduler.abort_request(rid, msg.message)
            if req is not None and req.finished:  # it was waiting: finished right away
                outputs.append(self._finish_output(req))
        if not self.generating:  # no step will release the running ones
            outputs += self.drain()
        return outputs

    def abort_all(self, message: str) -> list[ReqOutput]:
        return self._abort(AbortReq(None, message))

    def _all_rids(self) -> list[str]:
        s = self.scheduler
        queued = list(s.waiting) + s.running + ([s.chunked_req] if s.chunked_req else [])
        return self.grammars.rids() + [r.rid for r in queued]

    def has_work(self) -> bool:
        return self._busy() or bool(self.grammars.waiting)

    def _busy(self) -> bool:
        return self._inflight is not None or (self.generating and self.scheduler.has_work())

    @property
    def generating(self) -> bool:
        """False while paused or while any memory is released: requests wait in the queue."""
        return not self.paused and not self.memory_released

    def drain(self) -> list[ReqOutput]:
        """Finish the launched (overlap) batch and end the requests aborted while it ran: afterwards
        nothing runs on the device and no request waits for a step to be released. A batch that
        fails here fails its requests, as a failed step does."""
        inflight, self._inflight = self._inflight, None
        outputs: list[ReqOutput] = []
        if inflight is not None:
            try:
                outputs = self._process(inflight)
            except Exception as exc:
                logger.exception("the launched batch failed while draining; failing its requests")
                outputs = self.fail_current_batch(f"engine error: {type(exc).__name__}: {exc}")
        self.scheduler.finish_marked_aborts()
        return outputs + [self._finish_output(r) for r in self.scheduler.pop_finished()]

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """One scheduling round. With overlap, a decode step is launched before the previous
        step's tokens are read back, so host work hides behind the device's."""
        if not self._busy():  # only grammars compiling: wait a little for one instead of spinning
            self.grammars.wait(GRAMMAR_POLL_S)
        compiled = self._admit_compiled()
        if not self.generating:
            return compiled + self.drain()
        return compiled + self._step_generating()

    def _step_generating(self) -> list[ReqOutput]:
        inflight, self._inflight = self._inflight, None
        ahead = self.scheduler.schedule_lookahead(inflight.batch) if inflight is not None else None
        if ahead is not None:
            self.stats.num_lookahead_steps += 1
            if ahead.sample_after_commit:  # forward now; sampling once the tokens it reads are in
                self._uncommitted.append(ahead)
                forward = self.runner.forward(ahead, inflight)
                outputs = self._process(inflight, then=ahead)
                self._inflight = self.runner.sample(forward)
                return outputs
            self._inflight = self._launch(ahead, inflight)
            return self._process(inflight)
        outputs = self._process(inflight) if inflight is not None else []
        batch = self.scheduler.schedule()
        outputs += [self._finish_output(r) for r in self.scheduler.pop_finished()]
        if batch is not None:
            pending = self._launch(batch)
            if self.overlap:
                self._inflight = pending
            else:
                outputs += self._process(pending)
        return outputs

    def _launch(self, batch: ScheduleBatch, inflight: Optional[PendingResult] = None) -> PendingResult:
        self._uncommitted.append(batch)
        return self.runner.launch(batch, inflight)

    def _process(self, pending: PendingResult, then: Optional[ScheduleBatch] = None) -> list[ReqOutput]:
        """Commit a step's tokens. `then`: the lookahead batch launched meanwhile, whose grammar
        mask is filled in the background once the matchers have these tokens."""
        batch = pending.batch
        # joins the mask worker: the device may wait on its gate, and nothing reads a matcher while it advances
        self.runner.grammar_masks.drop()
        result = pending.resolve()
        self._record_stats(batch)
        grown = self.scheduler.commit(batch, result.next_token_ids)
        self._uncommitted.remove(batch)
        self._processing = batch
        constrained = [req for req in grown if req.grammar is not None]
        grammar_stops = self._advance_grammars(constrained)
        if then is not None and constrained:
            self.runner.prefetch_grammar_mask(then)
        self._record_logprobs(batch, result)
        outputs: list[ReqOutput] = []
        for req in grown:
            req.note_weight_version(self.weight_version)
            outputs.extend(self._after_token(req, grammar_stops.get(id(req))))
        for req in self._prompt_only(batch):  # max_new_tokens=0: prompt logprobs, no output
            req.finished_reason = {"type": "length", "length": 0}
            self.scheduler.release(req)
            outputs.append(self._finish_output(req))
        self._processing = None
        return outputs

    @staticmethod
    def _prompt_only(batch: ScheduleBatch) -> list[Req]:
        if batch.forward_mode.is_decode:
            return []
        return [r for r in batch.reqs if not r.finished and not r.is_chunked and r.sampling_params.max_new_tokens == 0]

    def _after_token(self, req: Req, grammar_stop: Optional[dict] = None) -> list[ReqOutput]:
        """grammar_stop: what the request's grammar said of this token (_advance_grammar)."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.detokenizer is not None and (req.stream or req.sampling_params.watches_text):
            self._detokenize(req)  # text is needed now; otherwise once, at the end
        reason = check_finished(req, self.parts.eos_token_ids, self.parts.context_len) or grammar_stop
        if reason is None:
            return [ReqOutput(req.rid, False, build_output(req, self))] if req.stream else []
        req.finished_reason = reason
        self.scheduler.release(req)
        return [self._finish_output(req)]

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

    def _finish_output(self, req: Req) -> ReqOutput:
        if req.detokenizer is not None and req.stop_text_len is None:
            self._detokenize(req)
            req.text += req.detokenizer.flush()
        return ReqOutput(req.rid, True, build_output(req, self))

    @staticmethod
    def _detokenize(req: Req) -> None:
        new_ids = req.output_ids[req.detokenized_len :]
        if new_ids:
            req.text += req.detokenizer.add(new_ids)
            req.detokenized_len = len(req.output_ids)

    def _record_logprobs(self, batch: ScheduleBatch, result: BatchResult) -> None:
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

    def _record_stats(self, batch: ScheduleBatch) -> None:
        self.stats.num_steps += 1
        if batch.forward_mode.is_decode:
            self.stats.num_generated_tokens += batch.batch_size
        else:
            n = batch.num_prefill_rows
            self.stats.num_prefill_tokens += sum(batch.extend_lens[:n])
            self.stats.num_cached_tokens += sum(batch.prefix_lens[:n])
            self.stats.num_generated_tokens += batch.num_decode_rows
            self.stats.num_mixed_steps += batch.num_decode_rows > 0

    def fail_current_batch(self, message: str) -> list[ReqOutput]:
        """After a failed step: end the requests of every launched batch with an error and give
        back their KV (slots of batches that never committed included)."""
        failed = []
        for batch in self._uncommitted:
            failed += self.scheduler.fail_batch(batch, message, slots_committed=False)
        if self._processing is not None:
            failed += self.scheduler.fail_batch(self._processing, message, slots_committed=True)
            # requests that finished just before the failure may not have been answered yet: a
            # second final answer for a request is dropped by the front end, a missing one hangs
            failed += [r for r in self._processing.reqs if r.finished and r not in failed]
        self._uncommitted, self._processing, self._inflight = [], None, None
        return [self._error_output(r, message) for r in failed]

    def _error_output(self, req: Req, message: str) -> ReqOutput:
        """A final answer built without the detokenizer or recorder (either may be what failed)."""
        if req.finished_reason is None or req.finished_reason.get("type") != "abort":
            req.finished_reason = {"type": "abort", "message": message}
        return ReqOutput(req.rid, True, build_output(req, self))


def _grammar_verdict(grammar, token: int, accepted: bool) -> Optional[dict]:
    if not accepted:
        why = getattr(grammar, "refusal", None) or f"the grammar refused token {token}: no allowed token was left"
        return {"type": "abort", "message": why}
    if grammar.is_terminated():
        return {"type": "stop", "matched": token}
    return None
