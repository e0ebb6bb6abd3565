"""Plans for the split-KV attention kernels: q blocks, splits, lanes and partial buffers.

A plan is made once per batch (`init_forward_metadata`) and shared by every layer. Decode plans
are built on the device from `seq_lens` with tensor ops only, so CUDA-graph replay can refresh
them in place; extend plans come from the host lists of the ForwardBatch (one H2D copy), built on
the first layer's call because the q-block height depends on the GQA group (q heads / kv heads),
which the backend first sees there.

Deterministic mode: splits of exactly `split_size` keys at absolute positions, and one tile for
extend and decode, except where prefill's taller tile was measured to give decode's bits (below).
Normal mode: a tall tile and a single split for extend (plain flash attention), a short tile and
length-proportional splits for decode.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.kernels.device_copy import h2d
from engine.kernels.split_kv_tile import KernelConfig, Tile, fit_shared_memory, next_pow2  # noqa: F401

SINGLE_SPLIT = 1 << 30  # a split size no sequence reaches: the whole key range is one split
MAX_LANES = 32  # programs per (q block, kv head) along the split axis
PROGRAMS_PER_SM = 4  # decode spreads splits over lanes until about this many programs per SM


# Measured on the H200 (scripts/gpu_attention_bench.py --sweep, Qwen3-8B heads): decode is a
# KV stream, and 128-key steps with a short 16-row tile reach 93-101% of the copy bandwidth at
# bs 256 (64-key steps: 53%; the old 32-row det tile of 64 keys a step: 37%).
# Deterministic prefill: 32 rows, the decode tile's 128 keys a step and warps; measured to give
# the 16-row tile's bits (scripts/det_extend_tile_probe.py, H100, Qwen3-8B's heads; the 0.6B's in
# `tandem train`'s rollout-vs-trainer logprobs; 64- and 128-row tiles or 8 warps do not) and to
# prefill 512-token prompts in 1.29 vs 1.77 ms. Other head shapes keep the decode tile
# (DET_EXTEND_MEASURED). TANDEM_DET_EXTEND_ROWS=16: the decode tile everywhere (A/B).
DEFAULT_CONFIGS = {
    "deterministic": KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=2, fp_fusion=False),
    "deterministic_extend": KernelConfig(block_m=int(os.environ.get("TANDEM_DET_EXTEND_ROWS", "32")), block_n=128,
                                         num_warps=4, num_stages=2, fp_fusion=False),
    "extend": KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "decode": KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=3),
}
# (q heads a kv head, bytes of a K row) where the deterministic prefill tile was measured: 16-bit
# K/V of head_dim 128 at GQA groups 2 (Qwen3-0.6B) and 4 (Qwen3-8B); elsewhere the decode tile
DET_EXTEND_MEASURED = {(2, 256), (4, 256)}
# Normal-mode decode: the shortest split worth its own program. 128 keys (one key block) halves
# the batch-1 step at short contexts vs 256 (10 vs 20 us per layer at 768 keys, same sweep).
MIN_DECODE_SPLIT = 128


def _same_row_arithmetic(tile: Tile, twin: Tile, group: int, kv_row_bytes: Optional[int]) -> bool:
    """Whether a taller tile computes each row as `twin` does: the same keys a step, warps and
    contraction, at a head shape where that was measured (DET_EXTEND_MEASURED)."""
    a, b = tile.config, twin.config
    same = (tile.block_n, a.num_warps, a.fp_fusion) == (twin.block_n, b.num_warps, b.fp_fusion)
    return same and (a.block_m == b.block_m or (group, kv_row_bytes) in DET_EXTEND_MEASURED)


def shared_memory_limit(device: torch.device) -> Optional[int]:
    """Per-block shared memory (opt-in maximum) of a CUDA device; None elsewhere (interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def decode_lanes(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Programs per (sequence, kv head) along the split axis; a function of bs only, so a
    CUDA graph captured for bs has the same grid as an eager step of that bs."""
    target = PROGRAMS_PER_SM * num_sms
    return max(1, min(MAX_LANES, math.ceil(target / (batch_size * num_kv_heads))))


def decode_split_lens(seq_lens: torch.Tensor, lanes: int, block_n: int,
                      min_split: int) -> torch.Tensor:
    """Normal mode: about seq_len / lanes keys per split, whole key blocks, at least min_split
    (MIN_DECODE_SPLIT: the shortest split worth its own program)."""
    per_lane = (seq_lens + lanes - 1) // lanes
    return (((per_lane + block_n - 1) // block_n) * block_n).clamp_min(min_split)


def decode_block_table(seq_lens: torch.Tensor, split) -> torch.Tensor:
    """int32 [5, bs]: (seq, tok_start, pos_start, ntok, split) with one token per sequence."""
    bs = seq_lens.numel()
    idx = torch.arange(bs, dtype=torch.int64, device=seq_lens.device)
    split = split if isinstance(split, torch.Tensor) else torch.full_like(seq_lens, split)
    return torch.stack([idx, idx, seq_lens - 1, torch.ones_like(seq_lens), split]).to(torch.int32)


def extend_block_table(prefix_lens: list[int], extend_lens: list[int], block_t: int,
                       split: int) -> torch.Tensor:
    """int32 [5, blocks] on the host: q blocks aligned at absolute positions [a*bt, (a+1)*bt),
    so a row lands in the same block row-range whatever chunk it arrives in."""
    pre = torch.tensor(prefix_lens, dtype=torch.int64)
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    tok0 = torch.cumsum(ext, 0) - ext
    first = pre // block_t
    nblk = torch.where(ext > 0, (pre + ext - 1) // block_t - first + 1, torch.zeros_like(ext))
    seq = torch.repeat_interleave(torch.arange(len(prefix_lens)), nblk)
    starts = torch.cumsum(nblk, 0) - nblk
    within = torch.arange(seq.numel()) - torch.repeat_interleave(starts, nblk)
    blk = first[seq] + within
    pos_start = torch.maximum(blk * block_t, pre[seq])
    pos_end = torch.minimum((blk + 1) * block_t, pre[seq] + ext[seq])
    tok = tok0[seq] + pos_start - pre[seq]
    split_col = torch.full_like(seq, split)
    return torch.stack([seq, tok, pos_start, pos_end - pos_start, split_col]).to(torch.int32)


@dataclass
class SplitKvPlan:
    """What the kernels need for one batch. `lanes == 1`: splits merged inside the program;
    `lanes > 1`: partials per split, merged by stage 2 (decode only)."""

    config: KernelConfig
    split: int  # split size used by Tile (deterministic) or its upper bound
    lanes: int = 1
    max_splits: int = 0  # partial-buffer stride along the split axis
    blocks: Optional[torch.Tensor] = None  # decode: int32 [5, >= num_blocks] on the device
    num_blocks: int = 0
    prefix_lens: Optional[list[int]] = None  # extend: host lists, table built per block_t
    extend_lens: Optional[list[int]] = None
    part_acc: Optional[torch.Tensor] = None  # [rows, H, max_splits, D] float32
    part_ml: Optional[torch.Tensor] = None  # [rows, H, max_splits, 2] float32
    # deterministic extend: the decode tile, whose keys a step (block_n, once fitted to the
    # device's shared memory) this plan's tile must share, else it runs that tile instead
    keys_config: Optional[KernelConfig] = None
    _tables: dict = field(default_factory=dict)  # tiles and extend block tables, built once

    def tile(self, group: int, kv_row_bytes: Optional[int] = None,
             device: Optional[torch.device] = None) -> Tile:
        key = ("tile", group, kv_row_bytes)
        if key not in self._tables:  # one per batch, not per layer
            limit = shared_memory_limit(device) if device is not None else None
            tile = Tile.build(self.config, group, self.split, kv_row_bytes, limit)
            if self.keys_config is not None:  # deterministic extend: decode's bits or decode's tile
                twin = Tile.build(self.keys_config, group, self.split, kv_row_bytes, limit)
                tile = tile if _same_row_arithmetic(tile, twin, group, kv_row_bytes) else twin
            self._tables[key] = tile
        return self._tables[key]

    def attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, scaling: float,
               prefix: Optional[tuple] = None) -> torch.Tensor:
        """Run the split-KV kernel for this plan: q [T, H, D] over the keys that req_to_token
        maps into k_buf / v_buf [slots, Hkv, D]. The one launch the engine backend and the
        trainer's PackedAttention share, so both compile and run the same kernel. prefix:
        shared-prefix decode's partials (engine/attention/cascade.py)."""
        from engine.kernels.split_kv_attention import split_kv_attention

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tile = self.tile(q.shape[1] // k_buf.shape[1], k_buf.shape[2] * k_buf.element_size(), q.device)
        blocks, num_blocks = self.block_table(tile.block_t, q.device)
        part_acc, part_ml = self.partials(q.shape[1], q.shape[2], q.device)
        split_kv_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, blocks, num_blocks,
                           scaling, tile, self.lanes, part_acc, part_ml, prefix)
        return out

    def block_table(self, block_t: int, device: torch.device) -> tuple[torch.Tensor, int]:
        if self.blocks is not None:
            return self.blocks, self.num_blocks
        key = ("blocks", block_t)
        if key not in self._tables:
            table = extend_block_table(self.prefix_lens, self.extend_lens, block_t, self.split)
            self._tables[key] = (h2d(table, device), table.shape[1])
        return self._tables[key]

    def partials(self, num_heads: int, head_dim: int, device: torch.device):
        if self.lanes == 1:
            return None, None
        if self.part_acc is None:  # eager decode: sized for this batch, kept for all layers
            rows = self.num_blocks
            self.part_acc = torch.empty((rows, num_heads, self.max_splits, head_dim),
                                        dtype=torch.float32, device=device)
            self.part_ml = torch.empty((rows, num_heads, self.max_splits, 2),
                                       dtype=torch.float32, device=device)
        return self.part_acc, self.part_ml
