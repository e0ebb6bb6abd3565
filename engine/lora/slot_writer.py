"""SlotWriter: an adapter copied into a LoRAPool slot by four foreach ops instead of ~1000 small ones.

A slot load zeroes the slot's part of every target linear's buffers, then copies each shard's
lora_A rows and lora_B columns in (engine/lora/lora_pool.py has the layout). Done op by op that was
a zero_ per buffer and two copies per shard: ~1000 Python-issued ops (and kernel launches) at
Qwen3-8B, on the compute stream at the first batch that uses the adapter. The destination views
of a slot depend only on the slot and the adapter's rank, so they are made once per (slot, rank)
(the pool's buffers are allocated once, for CUDA graphs, so views of them stay valid) and a load
is a few foreach calls: zero the slot's `a` parts and `b` parts, copy the A and the B shards.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch

from engine.lora.adapter import LoRAAdapter


class SlotBuffers(Protocol):
    """What the writer reads of a pool module (engine/lora/lora_pool.py's PoolModule, which
    imports this file): its [slots, ...] `a` and `b` buffers and its shards' output rows."""
    a: torch.Tensor
    shard_rows: Sequence[slice]

    @property
    def b(self) -> torch.Tensor: ...

Views = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # (module, first row of shard) -> (a, b) views


class SlotWriter:
    def __init__(self, modules: Mapping[str, SlotBuffers], max_rank: int) -> None:
        self.modules, self.max_rank = modules, max_rank
        self._slot_parts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # slot -> parts
        self._shard_views: dict[tuple[int, int], Views] = {}  # (slot, rank) -> destination views

    @torch.no_grad()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Zeroes the slot, then copies in the adapter's shards: A at rows p*R .. p*R + r of its
        module's `a` (p: the shard's place), B at its output rows, columns 0 .. r of `b`. A and B
        go in separate foreach calls: on the GPU a list of dense tensors of equal strides takes
        the fused path, and the B views (columns 0 .. r of R) may not be."""
        r = adapter.config.rank
        for parts in self._parts(slot):
            torch._foreach_zero_(parts)
        views = self._views(slot, r)
        dst_a, src_a, dst_b, src_b = [], [], [], []
        for name, module in adapter.modules.items():
            if name not in self.modules:
                continue  # not a linear the pool serves
            for shard in module.shards:
                a, b = views[name, shard.rows.start]
                dst_a.append(a)
                src_a.append(module.lora_a[shard.cols])
                dst_b.append(b)
                src_b.append(shard.lora_b)
        if dst_a:
            torch._foreach_copy_(dst_a, src_a)
            torch._foreach_copy_(dst_b, src_b)

    def _parts(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The slot's part of every `a` buffer, and of every `b` buffer."""
        parts = self._slot_parts.get(slot)
        if parts is None:
            bufs = self.modules.values()
            parts = self._slot_parts[slot] = ([buf.a[slot] for buf in bufs], [buf.b[slot] for buf in bufs])
        return parts

    def _views(self, slot: int, r: int) -> Views:
        views = self._shard_views.get((slot, r))
        if views is None:
            R = self.max_rank
            views = self._shard_views[slot, r] = {
                (name, rows.start): (buf.a[slot, p * R:p * R + r], buf.b[slot, rows, :r])
                for name, buf in self.modules.items() for p, rows in enumerate(buf.shard_rows)}
        return views
