"""CompilePool: grammars checked by compiling them in child processes, each under a time limit.

A compile inside xgrammar cannot be interrupted, and a pathological one runs for minutes and
allocates gigabytes (issue 27: 124-180 s and 4.2 GB for 6,000 optional properties). Here it runs
in a compile worker (engine/grammar/compile_worker.py) that is killed, and replaced, when it runs
over `compile_timeout_s`: that request gets a ValueError (a 400) at its limit, and nobody else
waits. Two lanes, so a simple grammar never queues behind a slow one: grammars of at most
SMALL_SPEC_BYTES have a worker of their own, the others share the rest. The workers start
together when the pool is made (the first grammar; importing xgrammar takes seconds, 4-8 s on a
loaded 2-core host), and that wait does not count against the time limit.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import time
from typing import Any, Optional

from engine.grammar.grammar_limits import GrammarLimits
from engine.grammar.server_process import ServerProcess

logger = logging.getLogger(__name__)

SMALL_SPEC_BYTES = 8 << 10
STARTUP_TIMEOUT_S = 120.0  # a worker's imports and setup, on a loaded host
WORKER_MAX_RSS_BYTES = 2 << 30  # a worker whose heap grew past this is replaced after its compile


class GrammarUnavailable(RuntimeError):
    """No worker can check the grammar now (shutting down, or all busy past the time limit): a 503."""


class _Slot:
    """One worker of a lane: started on first use, replaced when killed or exited."""

    def __init__(self) -> None:
        self.process: Optional[ServerProcess] = None
        self.ready = False


class CompilePool:
    def __init__(self, info: Any, vocab_size: int, limits: GrammarLimits, workers: int = 2) -> None:
        with tempfile.NamedTemporaryFile("w", prefix="tandem-tokinfo-", suffix=".json", delete=False) as f:
            f.write(info.serialize_json())  # the workers' vocabulary, without loading the tokenizer
        self._info_path, self._vocab_size = f.name, vocab_size
        self.limits = limits
        self._closed: Optional[str] = None  # why no grammar is checked any more
        self._slots: list[_Slot] = []
        self._lanes = (self._lane(1), self._lane(max(1, workers - 1)))  # (small grammars, the others)

    def _lane(self, n: int) -> "queue.Queue[_Slot]":
        lane: "queue.Queue[_Slot]" = queue.Queue()
        for _ in range(n):
            slot = _Slot()
            self._start(slot)  # all at once: they import in parallel
            self._slots.append(slot)
            lane.put(slot)
        return lane

    def check(self, kind: str, spec: str) -> int:
        """Compile (kind, spec) in a worker: the bytes the compiled grammar holds, or ValueError
        naming the problem (a bad grammar, or one that ran over the time limit)."""
        lane = self._lanes[0 if len(spec) <= SMALL_SPEC_BYTES else 1]
        slot = self._take(lane)
        try:
            return self._run(slot, kind, spec)
        finally:
            lane.put(slot)

    def close(self, reason: str = "the server is shutting down") -> None:
        """Kill every worker; checks in flight raise GrammarUnavailable naming `reason`."""
        self._closed = reason
        for slot in self._slots:
            if slot.process is not None:
                slot.process.kill()
                slot.process.join(1)  # reaped: no zombie per worker
        try:
            os.unlink(self._info_path)
        except OSError:
            pass

    # ---- inside --------------------------------------------------------------------------------
    def _take(self, lane: "queue.Queue[_Slot]") -> _Slot:
        """An idle worker of the lane, waited for at most one time limit (each holds one for at
        most that long)."""
        deadline = time.monotonic() + self.limits.compile_timeout_s
        while time.monotonic() < deadline:
            self._raise_if_closed()
            try:
                return lane.get(timeout=0.2)
            except queue.Empty:
                continue
        raise GrammarUnavailable(f"every grammar compile worker stayed busy for {self.limits.compile_timeout_s:g} s "
                                 "(--grammar-compile-workers); retry later")

    def _run(self, slot: _Slot, kind: str, spec: str) -> int:
        self._wait_ready(slot)
        slot.process.conn.send((kind, spec))
        reply = self._reply(slot, self.limits.compile_timeout_s)
        if reply is None:
            self._replace(slot, "ran over its time limit")
            raise ValueError(f"{kind} did not compile within {self.limits.compile_timeout_s:g} s "
                             f"(--grammar-compile-timeout); simplify the grammar")
        status, value, exiting = reply
        if exiting:
            self._replace(slot, "grew past its memory limit")
        if status == "error":
            raise ValueError(value)
        return value

    def _wait_ready(self, slot: _Slot) -> None:
        if slot.process is None:
            self._start(slot)
        self._raise_if_closed()
        if not slot.ready:
            try:
                reply = self._reply(slot, STARTUP_TIMEOUT_S)
            except ValueError:  # it died starting up: no fault of this grammar
                reply = None
            if reply != ("ready",):
                self._replace(slot, "did not start")
                raise GrammarUnavailable(f"the grammar compile worker did not start within {STARTUP_TIMEOUT_S:g} s")
            slot.ready = True

    def _reply(self, slot: _Slot, timeout_s: float) -> Optional[tuple]:
        """The worker's next message; None if none came within timeout_s. A worker that died
        mid-compile (e.g. std::bad_alloc aborts it) is a ValueError, or GrammarUnavailable at shutdown."""
        deadline = time.monotonic() + timeout_s
        conn = slot.process.conn
        while True:
            self._raise_if_closed()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                if conn.poll(min(left, 0.2)):
                    return conn.recv()
            except (EOFError, OSError):
                self._raise_if_closed()
                code = slot.process.exitcode
                self._replace(slot, f"died (exit code {code})")
                raise ValueError(f"the grammar's compile failed: its worker died (exit code {code}), "
                                 "most likely out of memory; simplify the grammar") from None

    def _replace(self, slot: _Slot, why: str) -> None:
        if slot.process is not None:
            logger.warning("grammar compile worker %s %s; starting another", slot.process.pid, why)
            slot.process.kill()
            slot.process.join(1)
            slot.process.conn.close()
        self._start(slot)

    def _start(self, slot: _Slot) -> None:
        slot.ready = False
        slot.process = None if self._closed is not None else ServerProcess(
            "engine.grammar.compile_worker", [self._info_path, self._vocab_size, WORKER_MAX_RSS_BYTES])

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise GrammarUnavailable(f"{self._closed}; the grammar was not compiled")
