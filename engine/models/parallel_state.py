"""TPGroup: the tensor-parallel process group of one engine, and the few collectives it needs.

Built from the process-group constructors over its own TCPStore, never `init_process_group`: the
default group of a process that also trains (or joins a weight-update group) stays its own.
Two groups share the store: `device` carries the forward pass's all-reduce / all-gather (NCCL on
GPUs, gloo on the CPU), `cpu` (always gloo) carries rank 0's pickled step messages to the other
ranks, as SGLang's broadcast_pyobj does.

Deterministic mode: with 2 ranks an all-reduce is one addition per element (a + b == b + a), so a
row's bits do not depend on the batch; they differ from TP=1's by rounding. With more ranks a
ring all-reduce (gloo's, NCCL's) splits the tensor into chunks by its size, so an element's order
of summation depends on the batch (measured: TP=4 over gloo was not batch invariant); there
`all_reduce(fixed_order=True)` gathers the partials and sums them in rank order instead.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# a worker waits for rank 0's next step in a broadcast: an idle engine must not time it out
IDLE_TIMEOUT = datetime.timedelta(days=7)
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class TPAddress:
    """Where the ranks of one engine meet: rank 0 hosts the TCPStore."""
    host: str
    port: int
    size: int
    backend: str  # "gloo" (CPU) or "nccl"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Every rank holds num_heads / tp q heads; kv heads split evenly or are replicated."""
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide num_attention_heads {num_heads}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} must divide num_key_value_heads {num_kv_heads} or be a multiple of it")


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """With more ranks than kv heads each rank keeps one (replicated across ranks), as SGLang does."""
    return max(1, num_kv_heads // tp_size)


class TPGroup:
    def __init__(self, address: TPAddress, rank: int, check_alive: Optional[Callable[[], None]] = None) -> None:
        """check_alive (rank 0): raises when a rank's process is gone; polled while rank 0 waits for
        the others to join, so a rank that died at start is named at once, not after the timeout."""
        self.rank, self.size, self.backend = rank, address.size, address.backend
        self._store = dist.TCPStore(address.host, address.port, address.size, is_master=rank == 0,
                                    timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)
        if rank == 0:
            _wait_for_ranks(self._store, self.size, check_alive or (lambda: None))
        else:
            self._store.set(f"tp_joined/{rank}", "1")
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp_cpu", self._store), rank, self.size, RENDEZVOUS_TIMEOUT)
        self.cpu.set_timeout(IDLE_TIMEOUT)
        if address.backend == "gloo":
            self.device = dist.ProcessGroupGloo(dist.PrefixStore("tp", self._store), rank, self.size,
                                                RENDEZVOUS_TIMEOUT)
            self.device.set_timeout(IDLE_TIMEOUT)
        else:
            self.device = dist.ProcessGroupNCCL(dist.PrefixStore("tp", self._store), rank, self.size)

    def close(self) -> None:
        """Shuts both groups down and drops the store (rank 0's stops listening): a stopped
        engine keeps no sockets or threads of its group. Collectives fail afterwards."""
        for pg in (self.device, self.cpu):
            try:
                pg.shutdown()
            except Exception:  # a group whose peers are gone: nothing left to tell them
                pass
        self.device = self.cpu = self._store = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        """Sum over ranks, in place. fixed_order: rank 0's + rank 1's + ..., whatever x's size
        (the deterministic mode; the same as the plain sum with 2 ranks)."""
        if not fixed_order or self.size == 2:
            self.device.allreduce([x]).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device.allgather([parts], [x.contiguous()]).wait()
        total = parts[0]
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along dim in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), over the device group."""
        self.device.broadcast(x, 0).wait()
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj on every rank (pickled; tensors inside must be on the CPU)."""
        if self.is_leader:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.cpu.broadcast(length, 0).wait()
        if not self.is_leader:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        self.cpu.broadcast(data, 0).wait()
        return obj if self.is_leader else pickle.loads(data.numpy().tobytes())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's obj, on every rank (small replies, e.g. a worker's load result)."""
        data = pickle.dumps(obj)
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.cpu.allgather([lengths], [length]).wait()
        width = int(max(t.item() for t in lengths))
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self.cpu.allgather([parts], [mine]).wait()
        return [pickle.loads(p[: int(n.item())].numpy().tobytes()) for p, n in zip(parts, lengths)]


def _wait_for_ranks(store: dist.TCPStore, size: int, check_alive: Callable[[], None]) -> None:
    """Until every other rank announced itself in the store, within the rendezvous timeout."""
    keys = [f"tp_joined/{r}" for r in range(1, size)]
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise RuntimeError(f"tensor-parallel rank(s) {', '.join(missing)} did not join rank 0 within "
                               f"{RENDEZVOUS_TIMEOUT.total_seconds():g} s")
        time.sleep(0.05)
