"""CoreClient: how the Engine reaches its EngineCore, through messages only.

`send` is fire-and-forget (generate, abort); `call` waits for the core's answer (control,
stats). Outputs come back through the `on_outputs` callback the Engine gives, on a thread that is
not the caller's. ThreadCoreClient runs the core on a worker thread of this process (tests, the
CPU, the in-process API); ProcessCoreClient (engine/api/process_client.py) runs it in its own
process, so tokenization, HTTP and the scheduler never share an interpreter.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from engine.config import ServerArgs
from engine.core.messages import CoreInfo, ReqOutput, StatsSnapshot
from engine.core.worker import STOP, CoreWorker

logger = logging.getLogger("tandem")
OnOutputs = Callable[[list[ReqOutput]], None]


class CoreDead(RuntimeError):
    """The core is gone (its process died or it was shut down): nothing more will be answered."""


class CoreClient:
    info: CoreInfo
    # the core's counters as it last reported them (it reports while it runs, and with every
    # StatsReq answer): what info routes serve when the core is too busy to answer at once
    latest_stats: Optional[StatsSnapshot] = None

    def send(self, msg: Any) -> None:
        self.send_all([msg])

    def send_all(self, msgs: list[Any]) -> None:
        """msgs reach the core together, in one read between two steps: a batch's requests are
        scheduled as one (the same batches, hence the same numbers, however busy the host is).
        Either all are sent or, when this raises, none is."""
        raise NotImplementedError

    def call(self, msg: Any, timeout: Optional[float] = None) -> Any:
        return self.call_future(msg).result(timeout)

    def call_future(self, msg: Any) -> Future:
        """Send a call; its Future resolves with the core's answer (or raises CoreDead)."""
        raise NotImplementedError

    def note_stats(self, stats: StatsSnapshot) -> None:
        self.latest_stats = stats

    def is_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class CallTable:
    """Futures of calls awaiting the core's answer, by call id."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed: Optional[Exception] = None  # set by fail_all: no call can be answered any more

    def open(self) -> tuple[int, Future]:
        fut: Future = Future()
        with self._lock:
            if self._closed is not None:  # checked under the lock: a call never waits on a dead core
                raise self._closed
            call_id = next(self._ids)
            self._futures[call_id] = fut
        return call_id, fut

    def close(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            fut = self._futures.pop(call_id, None)
        if fut is not None and fut.set_running_or_notify_cancel():  # a caller may have given up
            fut.set_result(value) if ok else fut.set_exception(value)

    def fail_all(self, exc: Exception) -> None:
        """Every waiting call raises exc, and so does every later `open`."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            self._closed = exc
        for fut in futures:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)


class ThreadCoreClient(CoreClient):
    """The core on a worker thread. If that thread dies (an error outside any one request or
    message, e.g. MemoryError), every waiting call and request in flight ends at once with
    CoreDead / a 503, as they do when a core process dies: nothing waits on a thread that is gone."""

    def __init__(self, server_args: ServerArgs, on_outputs: OnOutputs,
                 on_core_death: Optional[Callable[[str], None]] = None) -> None:
        from engine.core.engine_core import EngineCore

        self.core = EngineCore(server_args)  # white-box tests read it; nothing else does
        self.info = self.core.info()
        self._on_core_death = on_core_death
        self._dead: Optional[str] = None  # why the core is gone, once it is
        # each item a list of (message, call id): a batch is put at once, so the core reads it whole
        self._inbox: "queue.Queue[list[tuple[Any, Optional[int]]]]" = queue.Queue()
        self._pending: collections.deque = collections.deque()  # read from the inbox, not handled yet
        self._calls = CallTable()
        self._worker = CoreWorker(self.core, on_outputs, self._answer, report=self.note_stats)
        self._thread = threading.Thread(target=self._run, name="tandem-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._worker.run(self._next)
        except BaseException as exc:  # the loop itself failed: the core is gone
            logger.exception("the engine core thread died")
            self._died(f"the engine core thread died: {type(exc).__name__}: {exc}")
            try:  # its grammar workers and TP ranks must not outlive it
                self._worker.core.shutdown()
            except Exception:
                logger.exception("could not shut down the dead core's workers")
        else:
            self._died("the engine core is shut down", quietly=True)

    def _died(self, why: str, quietly: bool = False) -> None:
        self._dead = why
        self._calls.fail_all(CoreDead(why))
        if not quietly and self._on_core_death is not None:
            self._on_core_death(why)

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        if ok and isinstance(value, StatsSnapshot):
            self.note_stats(value)
        self._calls.close(call_id, ok, value)

    def _next(self, block: bool) -> Optional[tuple[Any, Optional[int]]]:
        if not self._pending:
            try:
                self._pending.extend(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            except queue.Empty:
                return None
        return self._pending.popleft()

    def _check_alive(self) -> None:
        if self._dead is not None or not self._thread.is_alive():
            raise CoreDead(self._dead or "the engine core is shut down")

    def send_all(self, msgs: list[Any]) -> None:
        self._check_alive()
        if not msgs:  # an empty item would leave the core's _next nothing to pop
            return
        self._inbox.put([(msg, None) for msg in msgs])

    def call_future(self, msg: Any) -> Future:
        self._check_alive()
        call_id, fut = self._calls.open()  # raises CoreDead once the thread is gone
        self._inbox.put([(msg, call_id)])
        return fut

    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put([(STOP, None)])
            self._thread.join(timeout=30)
        self._calls.fail_all(CoreDead("the engine core is shut down"))
        # The model, KV pool and req_to_token table go with the core: a shut-down Engine that is
        # still referenced (FastAPI's module-level caches keep every route closure over it) must
        # not keep them alive.
        self.core = None
        self._worker = None
