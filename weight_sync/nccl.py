"""WeightGroup: a process group of its own between a trainer and engines, for weight broadcasts.

The rendezvous is SGLang's `init_weights_update_group`: a TCPStore at master_address:master_port
(hosted by rank 0, the trainer), keys under the group's name, the trainer rank 0 and engine rank
`rank_offset` (+ its tensor-parallel rank). NCCL between GPUs, gloo on the CPU: the same code,
so CI runs it. Built from the process-group constructors, never `init_process_group`: the default
group of a process that also trains, or runs tensor parallelism, stays its own.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from weight_sync.base import LoadContext, WeightSender, WeightSource

BACKENDS = ("nccl", "gloo")


DEFAULT_RENDEZVOUS_TIMEOUT_S = 30.0  # SGLang has no such argument; its wait is the store's default


def check_group_args(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """The checks that need no peer, so a bad call is refused before any rendezvous starts."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use backend='gloo' on the CPU")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")


class WeightGroup:
    """`timeout_s` bounds the rendezvous (connecting to the store, every rank joining);
    `op_timeout_s` bounds each broadcast afterwards (gloo; NCCL keeps its own watchdog)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "nccl",
                 timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S, op_timeout_s: float = 600.0) -> None:
        check_group_args(rank, world_size, backend, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0 serves the store; the others connect to it, retrying until the timeout
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":  # its constructor is the rendezvous: it waits for every rank
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            self.pg.set_timeout(datetime.timedelta(seconds=op_timeout_s))
        else:  # NCCL connects lazily, at the first broadcast (which the trainer makes too)
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
        self._store.set_timeout(datetime.timedelta(seconds=op_timeout_s))
        self.rank, self.world_size, self.name, self.backend = rank, world_size, group_name, backend

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: rank `src` sends `tensor`, every other rank receives into it."""
        self.pg.broadcast(tensor, src).wait()
        return tensor

    def destroy(self) -> None:
        self.pg = None
        self._store = None


def parse_dtype(dtype) -> torch.dtype:
    """torch.bfloat16 or "bfloat16" / "torch.bfloat16" (the HTTP body's form)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as 'bfloat16'")
    return found


@dataclass
class GroupSource(WeightSource):
    """Tensors the trainer (rank 0 of `group_name`) broadcasts, one per name, in this order."""
    kind: ClassVar[str] = "distributed"
    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        model.load_weights(self.receive(ctx))

    def discard(self, ctx: LoadContext) -> None:
        """Receive and drop (an update refused for a reason of the engine's own): the trainer's
        broadcasts stay in step with this engine's receives."""
        self.receive(ctx)

    def receive(self, ctx: LoadContext) -> list:
        """Every dtype and shape is checked before the first receive: a malformed list cannot be
        received in step with the trainer (a name is checked after, with the tensors in hand)."""
        group = ctx.groups.get(self.group_name)
        if group is None:
            raise ValueError(f"no weight update group {self.group_name!r}: call init_weights_update_group first")
        specs = self._specs()
        try:
            return [(name, group.broadcast(torch.empty(shape, dtype=dtype, device=ctx.device)))
                    for name, dtype, shape in specs]
        except RuntimeError as exc:  # the trainer left or timed out mid-broadcast
            raise ValueError(f"broadcast from group {self.group_name!r} failed: {exc}") from exc

    def _specs(self) -> list:
        out_of_step = "nothing was received, so the trainer's broadcasts are now out of step with this engine"
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, "
                             f"{len(self.dtypes)}, {len(self.shapes)}); {out_of_step}")
        try:
            specs = [(str(name), parse_dtype(dtype), tuple(int(d) for d in shape))
                     for name, dtype, shape in zip(self.names, self.dtypes, self.shapes)]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{exc}; {out_of_step}") from exc
        bad = next((name for name, _, shape in specs if any(d < 0 for d in shape)), None)
        if bad is not None:
            raise ValueError(f"weight {bad!r} has a negative dimension; {out_of_step}")
        return specs


class GroupSender(WeightSender):
    """Trainer side: this process is rank 0 of `group`; per bucket, the engine's receive call
    (`update_weights_from_distributed`, which blocks) runs beside the broadcasts it waits for."""
    kind: ClassVar[str] = "distributed"

    def __init__(self, group: WeightGroup, group_name: str = "weight_update_group") -> None:
        self.group, self.group_name = group, group_name

    @classmethod
    def from_options(cls, group: Any = None, group_name: str = "weight_update_group", **_: Any) -> "GroupSender":
        if group is None:
            raise ValueError("transport 'distributed' needs group: this trainer's weight_sync.nccl.WeightGroup (rank 0)")
        return cls(group, group_name)

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        reply: list = []
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        receiver = threading.Thread(target=lambda: reply.append(engine.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, flush_cache=flush_cache, weight_version=weight_version)))
        receiver.start()
        for _, t in bucket:
            self.group.broadcast(t.contiguous(), src=0)
        receiver.join()
        return reply[0] if reply else (False, "the engine's receive call raised (see its log)")
