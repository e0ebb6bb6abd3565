"""LoRAPool: the adapters a batch runs, resident in fixed device buffers the Triton path reads.

Per target linear (those --lora-target-modules allows), allocated once at start-up (so CUDA graphs see fixed addresses):
  a [S, shards * R, in]   each shard's lora_A at rows p*R .. p*R + r (p: the shard's place in
                          the module, q/k/v or gate/up), zero-padded to R = the pool's max rank
  b [S, out, R]           each shard's lora_B at its output rows, columns 0 .. r, zeros elsewhere;
                          a view of b_rows [out, S * R] (every slot's B of an output row side by
                          side: the dense path's expand is then one plain GEMM per shard)
and scaling [S] float32. S = --max-loras-per-batch: the scheduler lets a batch use at most that
many distinct adapters (the base, counted as one by it, takes no slot: it is slot -1).

An adapter is copied into a slot when a batch needs it and it is not resident (device to device,
on the compute stream: a pass still running reads the old contents first). The slot taken is a
free one, else the least recently used unpinned adapter outside the batch. A pinned adapter keeps
its slot while loaded: admission keeps a batch's unpinned adapters within the slots the pinned ones
leave, and LoRAControl refuses a pin that would leave none (only requests already running when a
pin arrives can force a pinned one out; it is logged and loaded again when next used). Slots of
unloaded adapters are freed at the next batch. The scheduler and caches never touch the pool.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from engine.kernels.device_copy import h2d
from engine.lora.adapter import LoRAAdapter
from engine.lora.lora_batch import token_slots
from engine.lora.lora_config import LORA_TARGETS
from engine.lora.lora_paths import parse_lora_path
from engine.lora.pool_batch import LoRAPoolBatch
from engine.lora.slot_writer import SlotWriter
from engine.models.hf_names import DENSE_STACKING

logger = logging.getLogger(__name__)
DEFAULT_POOL_RANK = 64  # without --max-lora-rank or --lora-paths to infer it from


@dataclass
class PoolModule:
    a: torch.Tensor  # [S, shards * R, in]
    b_rows: torch.Tensor  # [out, S * R]
    shard_rows: list[slice]  # output rows of shard p

    @property
    def b(self) -> torch.Tensor:
        """[S, out, R]: slot-major view of b_rows (what the grouped kernels and slot loads index)."""
        return self.b_rows.view(self.b_rows.shape[0], self.a.shape[0], -1).permute(1, 0, 2)


class LoRAPool:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, dense: bool = True, targets: Sequence[str] = LORA_TARGETS) -> None:
        """targets: the HF linears adapters may target (--lora-target-modules); only their modules get buffers."""
        self.num_slots, self.max_rank, self.device = num_slots, max_rank, device
        self.dense = dense  # normal mode's passes use the dense path (pool_batch.py)
        self.modules = {m.lora_name: _allocate(m, num_slots, max_rank, device, dtype)
                        for m in model.modules() if getattr(m, "lora_name", "") and _targeted(m.lora_name, targets)}
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.slot_of: dict[int, int] = {}  # resident adapter id -> slot
        self._pinned: set[int] = set()
        self._last_use: dict[int, int] = {}  # adapter id -> tick of its last batch
        self._tick = itertools.count()
        self.loads = 0  # adapters copied in (tests read it)
        self._writer = SlotWriter(self.modules, max_rank)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b_rows))

    def prepare(self, lora_ids: list[Optional[int]], tokens_per_req: list[int], adapters: dict[int, LoRAAdapter],
                deterministic: bool) -> Optional[LoRAPoolBatch]:
        """The pass's LoRAPoolBatch (its adapters made resident); None when every request is the base's."""
        used = sorted({i for i in lora_ids if i is not None})
        if not used:
            return None
        self.make_resident(used, adapters)
        slots = token_slots(lora_ids, self.slot_of, tokens_per_req, torch.int32)
        return LoRAPoolBatch(self, h2d(slots, self.device), deterministic)

    def make_resident(self, used: list[int], adapters: dict[int, LoRAAdapter]) -> None:
        if len(used) > self.num_slots:
            raise ValueError(f"a batch uses {len(used)} LoRA adapters; the pool holds {self.num_slots}")
        for gone in [i for i in self.slot_of if i not in adapters]:  # unloaded: its slot is free
            del self.slot_of[gone], self._last_use[gone]
            self._pinned.discard(gone)
        tick = next(self._tick)
        for lora_id in used:
            if lora_id not in self.slot_of:
                self._load(self._take_slot(used), lora_id, adapters[lora_id])
            self._last_use[lora_id] = tick

    def _take_slot(self, used: list[int]) -> int:
        taken = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in taken]
        if free:
            return free[0]
        outside = [i for i in self.slot_of if i not in used]
        victims = [i for i in outside if i not in self._pinned] or outside
        victim = min(victims, key=self._last_use.__getitem__)
        if victim in self._pinned:
            logger.warning("LoRA pool: every free slot is needed by this batch; evicting pinned adapter %d", victim)
        self._pinned.discard(victim)
        del self._last_use[victim]
        return self.slot_of.pop(victim)

    def _load(self, slot: int, lora_id: int, adapter: LoRAAdapter) -> None:
        if adapter.config.rank > self.max_rank:  # LoRAControl refuses these at load; a guard
            raise ValueError(f"LoRA adapter {adapter.name!r}: rank {adapter.config.rank} > the pool's {self.max_rank}")
        self._writer.write(slot, adapter)
        self.scaling[slot] = adapter.config.scaling
        self.slot_of[lora_id] = slot
        if adapter.pinned:
            self._pinned.add(lora_id)
        self.loads += 1


def _targeted(lora_name: str, targets: Sequence[str]) -> bool:
    """Whether any HF linear stacked in this engine module (the one name map's rules) is among the targets."""
    short = lora_name.rpartition(".")[2]
    stacked = [rule.hf for rule in DENSE_STACKING if rule.engine == short]
    return any(t in targets for t in stacked or [short])


def _allocate(module: nn.Module, num_slots: int, rank: int, device: torch.device, dtype: torch.dtype) -> PoolModule:
    shard_ids = getattr(module, "shard_ids", None)
    rows = [module.shard_slice(s) for s in shard_ids] if shard_ids else [slice(0, module.out_features)]
    a = torch.zeros(num_slots, len(rows) * rank, module.in_features, dtype=dtype, device=device)
    b_rows = torch.zeros(module.out_features, num_slots * rank, dtype=dtype, device=device)
    return PoolModule(a, b_rows, rows)


def pool_rank(max_lora_rank: Optional[int], lora_paths: tuple[str, ...]) -> int:
    """--max-lora-rank, else the largest rank among --lora-paths (SGLang infers it so), else the default."""
    if max_lora_rank is not None:
        return max_lora_rank
    ranks = [_declared_rank(parse_lora_path(spec).lora_path) for spec in lora_paths]
    return max([r for r in ranks if r is not None], default=DEFAULT_POOL_RANK)


def _declared_rank(path: str) -> Optional[int]:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            rank = json.load(f).get("r")
    except (OSError, ValueError, AttributeError):
        return None  # the adapter's own load names the problem
    return rank if isinstance(rank, int) and rank > 0 else None
