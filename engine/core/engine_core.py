"""EngineCore: scheduler + model runner behind a narrow message interface.

The front end (Engine) sends ReqInput / AbortReq / FlushCacheReq messages through `handle` and
calls `step`, which returns ReqOutput messages. Nothing else crosses, so the core can later move
into its own process unchanged. This class is the step loop; requests enter through
RequestIntake (intake.py), a step's tokens become answers in StepResults (results.py), and pause,
weight updates and memory are GenerationControl's (control.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from engine.config import ServerArgs
from engine.gc_freeze import freeze_gc
from engine.core.control import GenerationControl
from engine.core.intake import RequestIntake, grammar_queue
from engine.core.lora_control import LORA_MESSAGES, LoRAControl
from engine.core.messages import (AbortReq, CheckIntegrityReq, ContinueReq, CoreInfo, DestroyWeightsGroupReq,
                                  FlushCacheReq, GetWeightVersionReq, InitWeightsGroupReq, PauseReq, ReleaseMemoryReq,
                                  ReqInput, ReqOutput, ResumeMemoryReq, SetWeightVersionReq, StatsReq, StatsSnapshot,
                                  UpdateWeightsReq)
from engine.core.messages import FreezeGCReq, WeightsGroupStatusReq
from engine.core.results import StepResults
from engine.core.setup import CoreParts, build_core_parts
from engine.core.stats import CoreStats
from engine.core.weight_reads import WEIGHT_READS, WeightReads
from engine.runner.pending_result import PendingResult
from engine.scheduler.batch import ScheduleBatch

logger = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.005  # an idle loop's wait for a compile: messages are read again after it
CONTROL_MESSAGES = (PauseReq, ContinueReq, UpdateWeightsReq, SetWeightVersionReq, InitWeightsGroupReq,
                    DestroyWeightsGroupReq, ReleaseMemoryReq, ResumeMemoryReq, WeightsGroupStatusReq)


class EngineCore:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.parts: CoreParts = build_core_parts(server_args)
        self.scheduler = self.parts.scheduler
        self.runner = self.parts.runner
        self.tokenizer = self.parts.tokenizer
        self.weight_version = server_args.weight_version
        self.paused = False  # pause_generation: no new forward passes until continue_generation
        self.control = GenerationControl(self)
        self.stats = CoreStats()
        # overlap scheduling: on by default on CUDA (SGLang's choice); the CPU gains nothing
        self.overlap = self.runner.device.type == "cuda" and not server_args.disable_overlap_schedule
        self._inflight: Optional[PendingResult] = None  # launched, result not read yet
        self._uncommitted: list[ScheduleBatch] = []  # launched, tokens not committed yet
        self._processing: Optional[ScheduleBatch] = None
        self.memory_released: set[str] = set()  # release_memory_occupation tags not yet resumed
        self.weight_reads = WeightReads(self)
        self.results = StepResults(self, self.scheduler, self.runner, self.parts.eos_token_ids,
                                   self.parts.context_len)
        self.grammars = grammar_queue(server_args, self.parts)
        self.lora = LoRAControl(self, server_args)
        self.intake = RequestIntake(self.parts, self.grammars, self.results, self.lora.resolve)

    # ---- messages ------------------------------------------------------------------------------
    def handle(self, msg: Any) -> Any:
        if isinstance(msg, ReqInput):
            if self.memory_released:
                self.control.note_request_while_released(msg.rid)
            return self.intake.add(msg)
        if isinstance(msg, AbortReq):
            return self.abort(msg)
        if isinstance(msg, CONTROL_MESSAGES):
            return self.control.handle(msg)
        if isinstance(msg, LORA_MESSAGES):
            return self.lora.handle(msg)
        if isinstance(msg, FlushCacheReq):
            return self.scheduler.flush_cache()
        if isinstance(msg, GetWeightVersionReq):
            return self.weight_version
        if isinstance(msg, StatsReq):
            return self.snapshot()
        if isinstance(msg, CheckIntegrityReq):
            return self.scheduler.check_integrity()
        if isinstance(msg, FreezeGCReq):
            return freeze_gc("engine core")
        if isinstance(msg, WEIGHT_READS):
            return self.weight_reads.handle(msg)
        raise TypeError(f"unknown message type {type(msg).__name__}")

    def abort(self, msg: AbortReq) -> list[ReqOutput]:
        outputs = self.intake.abort(msg.rid, msg.message, msg.prefix)
        if not self.generating:  # no step will release the running ones
            outputs += self.drain()
        return outputs

    def abort_all(self, message: str) -> list[ReqOutput]:
        return self.abort(AbortReq(None, message))

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
            max_running_requests=p.memory.max_running_requests, available_gb=p.memory.available_gb,
            lora_adapters=tuple(self.lora.registry.loaded_adapters().items()))

    def snapshot(self) -> StatsSnapshot:
        sched = self.scheduler
        return StatsSnapshot(
            **self.stats.counters(), num_retractions=sched.num_retractions,
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting) + len(self.grammars.waiting),
            new_token_ratio=float(sched.new_token_ratio),
            kv_tokens_used=sched.allocator.size - sched.allocator.available_size(),
            kv_tokens_total=sched.allocator.size, num_weight_updates=self.control.num_updates,
            weight_update_seconds=self.control.update_seconds, paused=self.paused,
            memory_released=tuple(sorted(self.memory_released)), weight_version=self.weight_version,
            uptime_s=time.perf_counter() - self.stats.started)

    # ---- stepping ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self._busy() or bool(self.grammars.waiting)

    def _busy(self) -> bool:
        return self._inflight is not None or (self.generating and self.scheduler.has_work())

    @property
    def generating(self) -> bool:
        """False while paused or while any memory is released: requests wait in the queue."""
        return not self.paused and not self.memory_released

    def step(self) -> list[ReqOutput]:
        """One scheduling round. With overlap, a decode step is launched before the previous
        step's tokens are read back, so host work hides behind the device's."""
        if not self._busy():  # only grammars compiling: wait a little for one instead of spinning
            self.grammars.wait(GRAMMAR_POLL_S)
        compiled = self.intake.admit_compiled()
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

                def sample_ahead() -> None:
                    self._inflight = self.runner.sample(forward)
                return self._process(inflight, then=ahead, sample_then=sample_ahead)
            self._inflight = self._launch(ahead, inflight)
            return self._process(inflight)
        outputs = self._process(inflight) if inflight is not None else []
        batch = self.scheduler.schedule()
        outputs += [self.results.finish(r) for r in self.scheduler.pop_finished()]
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

    def _process(self, pending: PendingResult, then: Optional[ScheduleBatch] = None,
                 sample_then: Optional[Callable[[], None]] = None) -> list[ReqOutput]:
        """Commit a step's tokens and answer for them (`then`, `sample_then`: see StepResults.answer)."""
        batch = pending.batch
        # joins the mask worker: the device may wait on its gate, and nothing reads a matcher while it advances
        self.runner.grammar_masks.drop()
        result = pending.resolve()
        grown = self.scheduler.commit(batch, result.next_token_ids)
        self.stats.record(batch, len(grown))
        self._uncommitted.remove(batch)
        self._processing = batch
        outputs = self.results.answer(batch, result, grown, then, sample_then)
        self._processing = None
        return outputs

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
        return outputs + [self.results.finish(r) for r in self.scheduler.pop_finished()]

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
        return [self.results.error(r, message) for r in failed]
