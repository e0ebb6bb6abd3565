"""CoreClient: how the Engine reaches its EngineCore, through messages only.

`send` is fire-and-forget (generate, abort); `call` waits for the core's answer (control,
stats). Outputs come back through the `on_outputs` callback the Engine gives, on a thread that is
not the caller's. ThreadCoreClient runs the core on a worker thread of this process (tests, the
CPU, the in-process API); ProcessCoreClient (engine/api/process_client.py) runs it in its own
process, so tokenization, HTTP and the scheduler never share an interpreter.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from engine.config import ServerArgs
from engine.core.messages import CoreInfo, ReqOutput
from engine.core.worker import STOP, CoreWorker

OnOutputs = Callable[[list[ReqOutput]], None]


class CoreDead(RuntimeError):
    """The core is gone (its process died or it was shut down): nothing more will be answered."""


class CoreClient:
    info: CoreInfo

    def send(self, msg: Any) -> None:
        raise NotImplementedError

    def call(self, msg: Any, timeout: Optional[float] = None) -> Any:
        raise NotImplementedError

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
        if fut is not None:
            fut.set_result(value) if ok else fut.set_exception(value)

    def fail_all(self, exc: Exception) -> None:
        """Every waiting call raises exc, and so does every later `open`."""
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
            self._closed = exc
        for fut in futures:
            fut.set_exception(exc)


class ThreadCoreClient(CoreClient):
    def __init__(self, server_args: ServerArgs, on_outputs: OnOutputs) -> None:
        from engine.core.engine_core import EngineCore

        self.core = EngineCore(server_args)  # white-box tests read it; nothing else does
        self.info = self.core.info()
        self._inbox: "queue.Queue[tuple[Any, Optional[int]]]" = queue.Queue()
        self._calls = CallTable()
        worker = CoreWorker(self.core, on_outputs, self._calls.close)
        self._thread = threading.Thread(target=worker.run, args=(self._next,), name="tandem-core", daemon=True)
        self._thread.start()

    def _next(self, block: bool) -> Optional[tuple[Any, Optional[int]]]:
        try:
            return self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, msg: Any) -> None:
        self._inbox.put((msg, None))

    def call(self, msg: Any, timeout: Optional[float] = None) -> Any:
        if not self.is_alive():
            raise CoreDead("the engine core is shut down")
        call_id, fut = self._calls.open()
        self._inbox.put((msg, call_id))
        return fut.result(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._inbox.put((STOP, None))
        self._thread.join(timeout=30)
        self._calls.fail_all(CoreDead("the engine core is shut down"))
        # The model, KV pool and req_to_token table go with the core: a shut-down Engine that is
        # still referenced (FastAPI's module-level caches keep every route closure over it) must
        # not keep them alive.
        self.core = None
