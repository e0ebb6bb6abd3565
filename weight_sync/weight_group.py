"""WeightGroup: a process group of its own between a trainer and engines, for weight broadcasts.

Formed the way SGLang's `init_custom_process_group` and slime's `init_process_group` form it, so
either one's trainer side meets tandem's engine side (and tandem's trainer side meets SGLang's
engines): a TCPStore at master_address:master_port hosted by rank 0 (the trainer), every client
counting itself in (`wait_for_workers`: without it the trainer's store waits forever, "1/2 clients
joined"), then the keys torch's `_new_process_group_helper` uses: PrefixStore(group_name) ->
"{group_name}/" -> "{device}/" ("cpu/" for gloo, "cuda/" for NCCL). Here the backend is built
from those prefixes directly, not through that private helper: the helper registers the name in
torch's global registry, which refuses a second group of one name in a process (two engines in
one process, a re-init before torch forgot the name). tests/weight_sync/test_group_formation.py
forms the trainer side with the helper itself, so a change of torch's key scheme shows there.

Ranks: the trainer is 0; an engine's tensor-parallel rank t is `rank_offset + t`. One `timeout_s`
bounds the rendezvous and every broadcast afterwards (SGLang's `timeout` does both): a dead or
silent peer fails the call within it instead of hanging, and the group is then broken (its
transport closed), so the caller destroys it and forms it again, on a fresh port.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")
DEFAULT_TIMEOUT_S = 30.0
DEVICE_PREFIX = {"gloo": "cpu", "nccl": "cuda"}  # the first device of torch's backend map for each


def check_group_args(rank: int, world_size: int, backend: str, timeout_s: float,
                     master_port: Optional[int] = None) -> None:
    """The checks that need no peer, so a bad call is refused before any rendezvous starts."""
    if master_port is not None and not 0 < master_port < 65536:
        raise ValueError(f"master_port must be a TCP port in [1, 65535]; got {master_port}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use backend='gloo' on the CPU")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")


class GroupBroken(RuntimeError):
    """A broadcast of this group failed or timed out; the group cannot be used again."""


class WeightGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "nccl",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        check_group_args(rank, world_size, backend, timeout_s, int(master_port))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # torch's tcp:// rendezvous store: multi_tenant (one server per port in a process),
        # wait_for_workers (rank 0 waits for every rank; each client counts itself in)
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                    timeout=self.timeout, wait_for_workers=True, multi_tenant=True)
        store = dist.PrefixStore(group_name, self._store)
        store = dist.PrefixStore(f"{DEVICE_PREFIX[backend]}/", dist.PrefixStore(f"{group_name}/", store))
        self.pg = _backend(backend, store, rank, world_size, self.timeout)
        self.pg._set_sequence_number_for_group()  # rank 0 publishes it in the store, the others read it
        self.rank, self.world_size, self.name, self.backend = rank, world_size, group_name, backend
        self.broken: Optional[str] = None

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """In place, without waiting: rank `src` sends `tensor`, every other rank receives into it."""
        self._check_usable()
        return self.pg.broadcast(tensor, src, self.timeout)

    def wait(self, work: dist.Work) -> None:
        """Bounded by the group's timeout; a failure breaks the group (its peers are out of step)."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            self.broken = _first_line(exc)
            self.pg.abort()  # later ops fail at once instead of each waiting out the timeout
            raise GroupBroken(f"broadcast in group {self.name!r} failed within {self.timeout.total_seconds():g} s: "
                              f"{self.broken}") from exc

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.wait(self.start_broadcast(tensor, src))
        return tensor

    def destroy(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()
        self.pg = None
        self._store = None

    def _check_usable(self) -> None:
        if self.pg is None:
            raise GroupBroken(f"group {self.name!r} was destroyed")
        if self.broken is not None:
            raise GroupBroken(f"group {self.name!r} failed earlier ({self.broken}); destroy it and form it again")


def _backend(backend: str, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    """The backend's constructor is the rendezvous: gloo connects every pair here; NCCL connects at
    the first broadcast (which every rank makes)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False  # as _new_process_group_helper builds it
    options._timeout = timeout
    with _nccl_errors_raise():
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


@contextlib.contextmanager
def _nccl_errors_raise() -> Iterator[None]:
    """NCCL's watchdog tears the whole process down on a timed-out collective by default; this
    group's failures (a dead trainer) must only fail the update, so its communicator is aborted and
    the error raised (mode 2, "clean up only"). Read once, by the constructor; a user's setting wins."""
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in os.environ:
        yield
        return
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    try:
        yield
    finally:
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)


def _first_line(exc: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
