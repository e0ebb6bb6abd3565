"""CascadeDecode: the triton backend's shared-prefix decode, on the device.

A SharedPrefixPlan (engine/attention/shared_prefix.py, made on the host by the runner) becomes
device tables once per batch; each layer then runs phase A (the groups' shared keys, one K/V read
per block of rows) and hands the partials to the split-KV kernel, which reduces each row's own
keys from there. Under CUDA graphs the tables are static buffers the replay refills: graphs of
at least GRAPH_MIN_BS rows are captured with phase A, whose blocks are all empty when the batch
shares nothing (one launch of programs that return at once, per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.shared_prefix import SharedPrefixPlan
from engine.attention.split_kv_plan import shared_memory_limit
from engine.kernels.device_copy import h2d
from engine.kernels.split_kv_tile import KernelConfig, Tile, fit_shared_memory, next_pow2

# Phase A's tile: a block of rows x query heads of one kv head, against 64-key steps.
SHARED_PREFIX_CONFIG = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
GRAPH_MIN_BS = 16  # smaller graphs decode without phase A (few rows: little to share)


@dataclass
class CascadeTables:
    """One batch's device tables: prefix_lens int32 [bs] (the key each row's own part starts
    at), blocks int32 [4, >= num_blocks] (SharedPrefixPlan.packed's), rows int32 [bs], and the
    partials phase A writes for phase B, float32 ml [bs, H, 2] and acc [bs, H, D]."""

    prefix_lens: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    rows: torch.Tensor
    ml: Optional[torch.Tensor] = None
    acc: Optional[torch.Tensor] = None


class CascadeDecode:
    def __init__(self) -> None:
        self.group: Optional[int] = None  # query heads per kv head, known from the first forward
        self.graph_tables: Optional[CascadeTables] = None  # static, max_bs rows
        self._graph_has_plan = False
        self._tiles: dict = {}

    def members(self) -> int:
        """Rows per phase-A block: the tile's rows over the padded query heads of a kv head."""
        return max(1, SHARED_PREFIX_CONFIG.block_m // next_pow2(self.group))

    def tile(self, k_buf: torch.Tensor) -> Tile:
        """Phase A's launch shape (no alignment to keep: every shared key is visible to every
        row); K/V stages shrunk to the device's shared memory as the split-KV tiles are."""
        key = (self.group, k_buf.shape[2] * k_buf.element_size(), k_buf.device)
        if key not in self._tiles:  # once per model: not a device query per layer
            cfg, limit = SHARED_PREFIX_CONFIG, shared_memory_limit(k_buf.device)
            if limit is not None:  # None: the interpreter, no limit
                cfg = fit_shared_memory(cfg, key[1], limit)
            self._tiles[key] = Tile(self.group, next_pow2(self.group), self.members(), cfg.block_n, cfg)
        return self._tiles[key]

    def attend_prefix(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      tables: CascadeTables, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, scaling: float) -> tuple:
        """Phase A for one layer; -> the prefix argument of split_kv_attention."""
        from engine.kernels.shared_prefix_attention import shared_prefix_partials

        if tables.ml is None:  # eager: sized for this batch, reused by every layer
            tables.ml, tables.acc = _partials(*q.shape, q.device)
        shared_prefix_partials(q, k_buf, v_buf, req_to_token, req_pool_indices, tables.blocks,
                               tables.num_blocks, tables.rows, tables.ml, tables.acc, scaling,
                               self.tile(k_buf))
        return tables.prefix_lens, tables.ml, tables.acc

    # ---- eager ---------------------------------------------------------------------------------
    def tables(self, plan: Optional[SharedPrefixPlan], device: torch.device) -> Optional[CascadeTables]:
        """The batch's tables, or None: no plan, or the model's heads not yet seen."""
        if plan is None or self.group is None or next_pow2(self.group) > SHARED_PREFIX_CONFIG.block_m:
            return None  # (a kv head with more query heads than phase A's tile has rows: plain decode)
        bs = plan.batch_size
        packed = h2d(plan.packed(self.members()), device)
        nb = (packed.numel() - 2 * bs) // 4  # prefix_lens, 4 x blocks, rows
        lens, blocks, rows = torch.split(packed, [bs, 4 * nb, bs])
        return CascadeTables(lens, blocks.view(4, nb), nb, rows)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_graph_state(self, max_bs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         device: torch.device) -> None:
        self.group = num_heads // num_kv_heads
        if next_pow2(self.group) > SHARED_PREFIX_CONFIG.block_m:
            return  # no phase A for such a model (tables() says the same)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
        self.graph_tables = CascadeTables(
            zeros(max_bs), zeros(4, max_bs), max_bs, zeros(max_bs),
            *_partials(max_bs, num_heads, head_dim, device))

    def graph_view(self, bs: int) -> Optional[CascadeTables]:
        """The static tables of a graph of bs rows (None: that graph has no phase A)."""
        g = self.graph_tables
        if g is None or bs < GRAPH_MIN_BS:
            return None
        return CascadeTables(g.prefix_lens[:bs], g.blocks[:, :bs], bs, g.rows[:bs], g.ml[:bs], g.acc[:bs])

    def refill(self, bs: int, plan: Optional[SharedPrefixPlan]) -> None:
        """Before a replay of the bs graph: the plan's tables, or none shared (no copy when the
        last replay shared nothing either)."""
        view = self.graph_view(bs)
        if view is None:
            return
        if plan is None:
            if self._graph_has_plan:
                self.graph_tables.prefix_lens.zero_()
                self.graph_tables.blocks[1].zero_()
                self._graph_has_plan = False
            return
        packed = h2d(plan.packed(self.members(), pad_to=bs), view.rows.device)
        lens, blocks, rows = torch.split(packed, [bs, 4 * bs, bs])
        view.prefix_lens.copy_(lens)
        view.blocks.copy_(blocks.view(4, bs))
        view.rows.copy_(rows)
        self._graph_has_plan = True


def _partials(rows: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase A's float32 partials of each row and head: (max, sum-exp) [rows, H, 2], acc [rows, H, D]."""
    return (torch.zeros((rows, heads, 2), dtype=torch.float32, device=device),
            torch.zeros((rows, heads, head_dim), dtype=torch.float32, device=device))
