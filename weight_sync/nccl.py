"""WeightGroup: a process group of its own between a trainer and engines, for weight broadcasts.

The rendezvous is SGLang's `init_weights_update_group`: a TCPStore at master_address:master_port
(hosted by rank 0, the trainer), keys under the group's name, the trainer rank 0 and engine rank
`rank_offset` (+ its tensor-parallel rank). NCCL between GPUs, gloo on the CPU: the same code,
so CI runs it. Built from the process-group constructors, never `init_process_group`: the default
group of a process that also trains, or runs tensor parallelism, stays its own.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


class WeightGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "nccl",
                 timeout_s: float = 600.0) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; use backend='gloo' on the CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0 serves the store; the others connect to it, retrying until the timeout
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
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
