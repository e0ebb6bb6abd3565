"""The trainer side of `tandem bench-sync --transport nccl`: a separate process, rank 0 of a weight group.

It holds a BucketTrainer (random weights of the checkpoint's shapes, already in flattened bucket
buffers, as trainers with contiguous parameter buffers keep them) and broadcasts every bucket, one
broadcast each, queued back to back: bucket k+1 goes as soon as the engine posts its receive,
while the engine loads bucket k. The engine process drives the receives (one
update_weights_from_distributed call per bucket, load_format "flattened_bucket"). NCCL between two
GPUs (the trainer on the second: NCCL refuses two ranks on one GPU), gloo on the CPU.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any


def _serve(conn: Any, kwargs: dict, group_args: dict) -> None:
    import torch

    from tandem.sync_trainer import BucketTrainer
    from weight_sync.weight_group import WeightGroup

    if kwargs["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(kwargs["device"]))
    trainer = BucketTrainer(**kwargs)
    group = WeightGroup(rank=0, **group_args)  # waits for the engine to join
    conn.send(trainer.layout())
    while True:
        method, args = conn.recv()
        if method == "stop":
            group.destroy()
            conn.send(None)
            return
        try:
            if method == "broadcast":
                answer = _broadcast(trainer, group)
            elif method == "bucket_specs":
                answer = [[(m.name, str(m.dtype).removeprefix("torch."), list(m.shape)) for m in b.metadata]
                          for b in trainer.buckets]
            else:
                answer = getattr(trainer, method)(*args)
        except Exception as exc:  # answered, and the trainer keeps serving (stop still reaches it)
            answer = _Failure(f"{type(exc).__name__}: {_first_line(exc)}")
        conn.send(answer)


class _Failure:
    """A call that raised in the trainer process: its error, raised again by the caller."""

    def __init__(self, text: str) -> None:
        self.text = text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else "no detail"


def _broadcast(trainer: Any, group: Any) -> float:
    """Every bucket, queued in order; -> time.monotonic() when the last one reached the engine
    (CLOCK_MONOTONIC: one clock for every process of the machine)."""
    works = [group.start_broadcast(b.flattened_tensor, src=0) for b in trainer.buckets]
    for work in works:
        group.wait(work)
    if trainer.device.type == "cuda":
        import torch

        torch.cuda.synchronize(trainer.device)
    return time.monotonic()


class GroupTrainerProcess:
    """A spawned trainer process, rank 0 of `group_name` at master_port; the engine joins as rank 1.
    `start` sends a call without waiting for its answer (the broadcast runs beside the engine's
    receives); `result` waits for it."""
    kind = "process"

    def __init__(self, group_args: dict, **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, kwargs, group_args), daemon=True)
        self._process.start()
        self.layout: dict = {}
        self._pending: list[str] = []  # calls sent, answers not read yet

    def joined(self, timeout_s: float) -> None:
        """After the engine joined: the trainer's layout, or its failure."""
        if not self._conn.poll(timeout_s):
            raise RuntimeError(f"the trainer process did not form the weight group within {timeout_s:g} s")
        try:
            self.layout = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the trainer process exited (code {self._process.exitcode}) before the "
                               f"weight group formed") from None

    def start(self, method: str, *args: Any) -> None:
        try:
            self._conn.send((method, args))
        except OSError:  # its end of the pipe is closed
            self._process.join(5)
            raise RuntimeError(f"the trainer process exited (code {self._process.exitcode}) before its call "
                               f"{method}") from None
        self._pending.append(method)

    def result(self) -> Any:
        """The oldest call's answer; its failure in the trainer, or the trainer's exit, raised."""
        method = self._pending.pop(0)
        try:
            while not self._conn.poll(1.0):  # a call's own waits are bounded (the group's timeout)
                if not self._process.is_alive():
                    raise EOFError
            answer = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"the trainer process exited (code {self._process.exitcode}) during its call "
                               f"{method}") from None
        if isinstance(answer, _Failure):
            raise RuntimeError(f"the trainer's call {method} failed: {answer.text}")
        return answer

    def call(self, method: str, *args: Any) -> Any:
        self.start(method, *args)
        return self.result()

    def stop(self) -> None:
        """Also after a failure elsewhere: an answer still owed (a broadcast the engine stopped
        receiving ends within the group's timeout) is read and dropped first."""
        try:
            while self._pending:
                try:
                    self.result()
                except RuntimeError:
                    pass
            if self._process.is_alive():
                self.call("stop")
        except (RuntimeError, OSError):
            pass
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
