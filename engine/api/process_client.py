"""ProcessCoreClient: the EngineCore in its own process, so HTTP, tokenization and
detokenization never share an interpreter (or its GIL) with the scheduler and the model.

The child is started with the 'spawn' context (safe with CUDA, engine/api/core_spawn.py; `tandem
serve` starts it before its own imports and hands it over) and runs engine/core/process_main.py. Messages are pickled with torch's ForkingPickler in the caller's
thread (a message that cannot cross fails there, at once), so tensors inside a weight update
travel by reference (CPU shared memory, CUDA IPC handles) and reach the core unchanged. A sender
thread writes queued messages to the pipe in batches, so the caller never blocks on a full pipe;
a receiver thread delivers each step's outputs (one message per step) and resolves calls.
If the core process dies, every pending and later call raises CoreDead naming its exit code,
and `on_core_death` ends the requests in flight with that message: never a hang.
As with any 'spawn' process, a script that starts an Engine(core_process=True) needs the
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import atexit
import logging
import queue
import signal
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch.multiprocessing  # noqa: F401  (registers the tensor reductions on ForkingPickler)
from multiprocessing.reduction import ForkingPickler

from engine.api.core_client import CallTable, CoreClient, CoreDead, OnOutputs
from engine.api.core_spawn import SpawnedCore, spawn_core
from engine.config import ServerArgs
from engine.core.messages import CoreInfo, StatsSnapshot
from engine.core.worker import STOP

logger = logging.getLogger("tandem")
OnDeath = Callable[[str], None]
STOP_TIMEOUT_S = 30.0  # a graceful stop finishes the current step; then the process is killed
STARTUP_POLL_S = 1.0
STARTUP_EXIT_TIMEOUT_S = 10.0  # a child that reported its start-up error exits by itself


class CoreStartupError(RuntimeError):
    """The core process exited during start-up without saying why (e.g. killed, out of memory)."""


class ProcessCoreClient(CoreClient):
    def __init__(self, server_args: ServerArgs, on_outputs: OnOutputs,
                 on_core_death: Optional[OnDeath] = None, spawned: Optional[SpawnedCore] = None) -> None:
        """spawned: a core process already started for these server_args (engine/api/core_spawn.py)."""
        self._on_outputs = on_outputs
        self._on_core_death = on_core_death
        self._calls = CallTable()
        # each item a list of (pickled message, call id), written to the pipe whole; None: stop
        self._outbox: "queue.Queue[Optional[list[tuple[bytes, Optional[int]]]]]" = queue.Queue()
        self._dead: Optional[str] = None  # why the core is gone, once it is
        self._stopping = False
        if spawned is not None and spawned.server_args != server_args:
            spawned.kill()
            raise ValueError("the core process was spawned for other server arguments than this engine's")
        spawned = spawned or spawn_core(server_args)
        self.process, self._conn = spawned.process, spawned.conn
        try:
            self.info: CoreInfo = self._wait_for_info()
        except BaseException:
            self._reap(STARTUP_EXIT_TIMEOUT_S)
            self._conn.close()
            raise
        atexit.register(self.shutdown)  # a non-daemon child would otherwise hold up interpreter exit
        self._receiver = threading.Thread(target=self._receive, name="tandem-core-receiver", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="tandem-core-sender", daemon=True)
        self._receiver.start()
        self._sender.start()

    # ---- start-up ------------------------------------------------------------------------------
    def _wait_for_info(self) -> CoreInfo:
        """Model loading and graph capture can take minutes: wait while the child lives."""
        while not self._conn.poll(STARTUP_POLL_S):
            if not self.process.is_alive():
                break
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise CoreStartupError(
                f"the engine core process exited during start-up ({self._exit_text()}) without a reason; "
                "its log above may say why (out of memory? a script that starts Engine(core_process=True) "
                "needs `if __name__ == '__main__':`, as every 'spawn' process does)") from None
        if reply[0] == "info":
            return reply[1]
        _, exc, text = reply
        note = f"raised in the engine core process during start-up:\n{text}"
        if exc is None:
            raise CoreStartupError(f"the engine core process failed to start:\n{text}")
        exc.add_note(note)
        raise exc

    # ---- CoreClient ----------------------------------------------------------------------------
    def send_all(self, msgs: list[Any]) -> None:
        self._check_alive()
        if not msgs:  # nothing to send
            return
        payloads = [(_pickled(msg), None) for msg in msgs]  # all pickled before any is queued
        self._outbox.put(payloads)

    def call_future(self, msg: Any) -> Future:
        self._check_alive()
        payload = _pickled(msg)
        call_id, fut = self._calls.open()  # raises CoreDead once the core is gone
        self._outbox.put([(payload, call_id)])
        return fut

    def is_alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            self._outbox.put([(_pickled(STOP), None)])
        self._outbox.put(None)  # the sender's own stop, after STOP is written
        self._reap(STOP_TIMEOUT_S)
        self._receiver.join(5)  # it read EOF: the requests still in flight were failed
        self._sender.join(5)
        self._conn.close()

    # ---- threads -------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        """Writes everything queued so far as one pipe message (fewer syscalls under load); a
        batch put at once is never split across two messages."""
        while True:
            items = [self._outbox.get()]
            while items[-1] is not None:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            batch = [pair for item in items if item is not None for pair in item]
            if batch and self._dead is None:
                try:
                    self._conn.send(batch)
                except OSError:  # the core is gone; the receiver reports it
                    return
            if stop:
                return

    def _receive(self) -> None:
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # one message that does not rebuild here; the pipe stays in step
                logger.exception("could not read a message from the engine core")
                continue
            try:
                if reply[0] == "outputs":
                    self._on_outputs(reply[1])
                elif reply[0] == "stats":
                    self.note_stats(reply[1])
                else:
                    _, call_id, ok, value = reply
                    if ok and isinstance(value, StatsSnapshot):
                        self.note_stats(value)
                    self._calls.close(call_id, ok, value)
            except Exception:  # a failing receiver must not stop the others' answers
                logger.exception("could not deliver a message from the engine core")
        self._core_exited()

    def _core_exited(self) -> None:
        if self._stopping:
            self._dead = "the engine core is shut down"
        else:
            self.process.join(5)
            self._dead = f"the engine core process exited unexpectedly ({self._exit_text()})"
            logger.error("%s; failing every request in flight", self._dead)
        self._calls.fail_all(CoreDead(self._dead))
        if self._on_core_death is not None:
            self._on_core_death(self._dead)

    # ---- pieces --------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise CoreDead(self._dead)
        if self._stopping:
            raise CoreDead("the engine core is shut down")

    def _exit_text(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running, but its pipe closed"
        if code < 0:
            try:
                return f"exit code {code}, killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exit code {code}"

    def _reap(self, timeout: float) -> None:
        """Wait up to timeout for the child to exit, then kill it."""
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine core process did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(5)


def _pickled(msg: Any) -> bytes:
    """msg pickled with torch's reductions: its tensors go by reference (shared memory, CUDA IPC)."""
    return bytes(ForkingPickler.dumps(msg))
