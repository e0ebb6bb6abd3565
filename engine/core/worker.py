"""CoreWorker: the loop that drives one EngineCore, on a thread or in the core's own process.

It takes messages while there is nothing to run (blocking briefly) and between steps (without
blocking), steps while there is work, and hands every output and reply to the two callbacks it
was given: the front end's dispatcher on a thread, a pipe back to the front end in a process.
A failing message or step never kills the loop: the requests it concerned get an error answer.
A weight update whose payload must first be fetched from its sender is opened off the step
(engine/core/payload_opener.py) and handled once opened; the core keeps stepping meanwhile. An
update that must wait for the running requests (GenerationControl.must_wait) is held here, in
order with any update behind it, while no new request starts.
While it works it reports the core's counters (`report`) every REPORT_INTERVAL_S, and once more
when it goes idle: the front end serves /metrics and the other info routes from the last report
when the core is too busy to answer (a long step, a weight load).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Optional

from engine.core.engine_core import EngineCore
from engine.core.messages import LoadLoraReq, ReqOutput, Reply, StatsSnapshot, UpdateWeightsReq
from engine.core.payload_opener import PayloadOpener

logger = logging.getLogger("tandem")

Emit = Callable[[list[ReqOutput]], None]
Answer = Callable[[int, bool, Any], None]  # (call id, ok, value or exception)
NextMessage = Callable[[bool], Optional[tuple[Any, Optional[int]]]]  # block? -> (msg, call id) | None

Report = Callable[[StatsSnapshot], None]

STOP = "stop"  # the message that ends the loop
OPEN_POLL_S = 0.05  # an otherwise idle loop's wait for a payload being opened (it wakes the loop when done)
REPORT_INTERVAL_S = 0.25


class CoreWorker:
    def __init__(self, core: EngineCore, emit: Emit, answer: Answer, report: Optional[Report] = None) -> None:
        self.core = core
        self.emit = emit
        self.answer = answer
        self.opener = PayloadOpener()
        self._lora_loads: set[Optional[int]] = set()  # call ids of LoRA loads being opened: refused in their shape
        self._held_updates: deque[tuple[UpdateWeightsReq, Optional[int]]] = deque()  # waiting for requests to end
        self.report = report
        self._reported = float("-inf")  # time.monotonic() of the last report
        self._changed = True  # a message or step ran since the last report

    def run(self, next_message: NextMessage) -> None:
        while True:
            block = not self.core.has_work() and not self.opener.pending and not self._held_updates
            self._maybe_report(block)
            item = next_message(block)
            while item is not None:
                self._changed = True
                if item[0] == STOP:
                    self.core.shutdown()
                    return
                self.handle(*item)
                item = next_message(False)
            self._handle_opened()
            self._run_held_updates()
            if self.core.has_work():
                self._changed = True
                self._emit(self._safe_step())
            elif self.opener.pending:
                self.opener.wait(OPEN_POLL_S)

    def _maybe_report(self, idle: bool) -> None:
        if self.report is None:
            return
        now = time.monotonic()
        if self._changed and (idle or now - self._reported >= REPORT_INTERVAL_S):
            self._reported, self._changed = now, False
            self.report(self.core.snapshot())

    def handle(self, msg: Any, call_id: Optional[int]) -> None:
        if self.opener.wants(msg):
            if isinstance(msg, LoadLoraReq) and call_id is not None:
                self._lora_loads.add(call_id)
            refusal = self.opener.start(msg, call_id)
            if refusal is not None:
                self._refuse_update(call_id, refusal)
            return
        self._run_or_hold(msg, call_id)

    def _handle_opened(self) -> None:
        for msg, call_id, refusal in self.opener.finished():
            if refusal is not None:
                self._refuse_update(call_id, refusal)
            else:
                self._lora_loads.discard(call_id)
                self._run_or_hold(msg, call_id)

    def _run_or_hold(self, msg: Any, call_id: Optional[int]) -> None:
        if not isinstance(msg, UpdateWeightsReq):
            self._run(msg, call_id)
            return
        scheduler = self.core.scheduler
        cutoff = scheduler.admission.admit_before if self._held_updates else scheduler.arrivals
        if not self._held_updates and not self.core.control.must_wait(msg, cutoff):
            self._run(msg, call_id)
            return
        if not self._held_updates:
            logger.info("weight update waits for the %d request(s) sent before it to end; later ones wait for it "
                        "(pause_generation first to update at once)", scheduler.num_in_flight_before(cutoff))
        self._held_updates.append((msg, call_id))  # behind a held one: in order, whatever it asks
        scheduler.admission.admit_before = cutoff

    def _run_held_updates(self) -> None:
        """The held updates, in order, once the first need not wait any more; then requests start again."""
        admission = self.core.scheduler.admission
        while self._held_updates and not self.core.control.must_wait(self._held_updates[0][0], admission.admit_before):
            self._run(*self._held_updates.popleft())
        if not self._held_updates:
            admission.admit_before = None

    def _refuse_update(self, call_id: Optional[int], refusal: str) -> None:
        """As control refuses an update before writing: (False, reason), weights untouched; a LoRA
        load as LoRA control refuses one."""
        if call_id in self._lora_loads:
            self._lora_loads.discard(call_id)
            self.answer(call_id, True, self.core.lora.refusal(refusal))
        elif call_id is not None:
            self.answer(call_id, True, (False, f"Weights not updated: {refusal}"))

    def _run(self, msg: Any, call_id: Optional[int]) -> None:
        try:  # a plain function only comes from tests, on a thread: it runs on the core thread
            result = msg(self.core) if callable(msg) else self.core.handle(msg)
        except Exception as exc:  # a failing message must not kill the worker
            if call_id is not None:
                self.answer(call_id, False, exc)
            else:
                logger.exception("engine could not take message %s", type(msg).__name__)
                self._emit(_failed_request(msg, exc))
            return
        if isinstance(result, Reply):  # a control message: deliver what it finished, then answer
            self._emit(result.outputs)
            result = result.value
        if call_id is not None:
            self.answer(call_id, True, result)
        elif isinstance(result, list):
            self._emit(result)

    def _safe_step(self) -> list[ReqOutput]:
        try:
            return self.core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests of that batch")
            return self.core.fail_current_batch(f"engine error: {type(exc).__name__}: {exc}")

    def _emit(self, outputs: list[ReqOutput]) -> None:
        if outputs:
            self.emit(outputs)


def _failed_request(msg: Any, exc: Exception) -> list[ReqOutput]:
    rid = getattr(msg, "rid", None)
    if rid is None:
        return []
    return [ReqOutput.error(rid, f"engine error: {type(exc).__name__}: {exc}")]
