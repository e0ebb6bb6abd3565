"""The engine core's own process: build an EngineCore, then drive it with a CoreWorker whose
inbox is a pipe from the front end (engine/api/process_client.py is the other end).

Wire protocol, over one duplex multiprocessing connection (torch's reductions are registered, so
tensors inside messages travel by reference: CPU shared memory, CUDA IPC handles):
  front end -> core: a list of (pickled message, call id or None) pairs; STOP ends the loop.
  core -> front end: ("info", CoreInfo) once at start-up, or ("startup_error", exception, traceback);
                     then ("outputs", [ReqOutput, ...]) — every output of one step in one message —
                     ("answer", call id, ok, value or exception), and ("stats", StatsSnapshot) while it
                     runs (engine/core/worker.py reports).
This module imports nothing of engine.api or the server: the core process never loads them.
"""

from __future__ import annotations

import collections
import logging
import pickle
import select
import signal
import threading
import traceback
from typing import Any, Optional

import torch.multiprocessing  # noqa: F401  (registers the tensor reductions on ForkingPickler)

from engine.config import ServerArgs, configure_logging
from engine.core.messages import ReqOutput
from engine.core.worker import STOP, CoreWorker
from engine.gc_freeze import freeze_gc

logger = logging.getLogger("tandem")
IDLE_POLL_S = 0.5  # how long an idle core waits for a message before looking again


class PipeInbox:
    """The worker's `next_message`: (message, call id) pairs read from the pipe, a batch at a time.
    Each message was pickled on its own by the front end; one that fails to unpickle here (e.g.
    a CUDA IPC handle this process cannot open) answers its call with the error."""

    def __init__(self, conn: Any, answer: Any) -> None:
        self.conn = conn
        self.answer = answer
        self.pending: collections.deque = collections.deque()
        self._poller = select.poll()  # ~0.6 us per look between steps; Connection.poll costs ~6 us
        self._poller.register(conn.fileno(), select.POLLIN)

    def __call__(self, block: bool) -> Optional[tuple[Any, Optional[int]]]:
        while True:
            if not self.pending and not self._read(IDLE_POLL_S if block else 0.0):
                return None
            payload, call_id = self.pending.popleft()
            try:
                return pickle.loads(payload), call_id
            except Exception as exc:
                logger.exception("engine core: could not unpickle a message")
                if call_id is not None:
                    self.answer(call_id, False, RuntimeError(
                        f"the engine core could not receive the message: {type(exc).__name__}: {exc}"))

    def _read(self, timeout: float) -> bool:
        try:
            if self._poller.poll(timeout * 1000):  # readable, or closed (then recv raises EOFError)
                self.pending.extend(self.conn.recv())
        except (EOFError, OSError):  # the front end is gone: nobody is left to answer
            self.pending.append((pickle.dumps(STOP), None))
        return bool(self.pending)


class PipeSender:
    """The worker's `emit` and `answer`: each writes one message to the front end."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def outputs(self, outputs: list[ReqOutput]) -> None:
        self.conn.send(("outputs", outputs))

    def stats(self, snapshot: Any) -> None:
        self.conn.send(("stats", snapshot))

    def answer(self, call_id: int, ok: bool, value: Any) -> None:
        if not ok:
            value = _portable_error(value)
        try:
            self.conn.send(("answer", call_id, ok, value))
        except OSError:  # the front end is gone: the loop ends
            raise
        except Exception as exc:  # pickling failed, before any byte was sent
            error = RuntimeError(f"the core's answer could not be sent back: {type(exc).__name__}: {exc}"
                                 f" (answer was {type(value).__name__}: {value!r:.200})")
            self.conn.send(("answer", call_id, False, error))


def _portable_error(exc: BaseException) -> BaseException:
    """exc if it rebuilds after pickling (what the front end will do), else a RuntimeError
    carrying its type and message: an answer the front end cannot read would leave its caller waiting."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def run_core_process(server_args: ServerArgs, conn: Any) -> None:
    """Entry point of the core process (started with the 'spawn' context)."""
    logging.basicConfig(format="[%(asctime)s core] %(message)s")  # lines marked as the core's
    configure_logging(server_args.log_level)
    # Ctrl-C reaches the whole process group: the front end stops the core (STOP, or EOF if it dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core = _start_core(server_args, conn)
    if core is None:
        return
    sender = PipeSender(conn)
    worker = CoreWorker(core, sender.outputs, sender.answer, report=sender.stats)
    # The loop runs on a thread, as the thread core's does: on the CPU, torch's OpenMP team of the
    # main thread spin-waits and was measured 5-20x slower per step on a busy 2-core machine
    loop = threading.Thread(target=_run_loop, args=(worker, PipeInbox(conn, sender.answer)), name="tandem-core")
    loop.start()
    loop.join()
    conn.close()


def _run_loop(worker: CoreWorker, inbox: PipeInbox) -> None:
    try:
        worker.run(inbox)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        logger.warning("engine core: the front end went away; exiting")


def _start_core(server_args: ServerArgs, conn: Any) -> Any:
    """The EngineCore, with its CoreInfo sent to the front end; or None after sending the error."""
    from engine.core.engine_core import EngineCore

    try:
        core = EngineCore(server_args)
        conn.send(("info", core.info()))
        # our process: start-up's objects are never scanned again (its collect, ~0.1 s, runs while
        # the front end finishes its own start-up)
        freeze_gc("engine core process")
        return core
    except BaseException as exc:  # every start-up failure goes back to the parent, then we exit
        text = traceback.format_exc()
        portable = _portable_error(exc)
        conn.send(("startup_error", portable if portable is exc else None, text))
        conn.close()
        return None
