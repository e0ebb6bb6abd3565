"""write_decode_table: a decode batch's split-KV block table in one launch.

The table the attention kernels read (engine/attention/split_kv_plan.py: decode_block_table, with
decode_split_lens in normal mode) took about a dozen small torch ops: arange, the split-length
arithmetic, stack, the int32 cast, the copy into the graph's buffer. Inside every captured decode
graph each is its own kernel, a few microseconds apiece at batch 1 (a ~1.1 ms step). Here they are
one program per 1024 rows with the same integer arithmetic, so the same table bit for bit.

Imports triton: import this module only where the triton backend is in use.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _decode_table_kernel(seq_lens_ptr, prefix_ptr, out_ptr, stride_row, bs, fixed_split, lanes, block_n,
                         min_split, FIXED: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < bs
    seq_len = tl.load(seq_lens_ptr + i, mask=mask, other=1).to(tl.int64)
    if FIXED:
        split = tl.zeros([BLOCK], dtype=tl.int64) + fixed_split
    else:
        own = seq_len
        if HAS_PREFIX:  # cascade: only the keys past the row's shared prefix are split
            own = seq_len - tl.load(prefix_ptr + i, mask=mask, other=0).to(tl.int64)
        per_lane = (own + lanes - 1) // lanes
        split = tl.maximum(((per_lane + block_n - 1) // block_n) * block_n, min_split)
    row = i.to(tl.int32)
    tl.store(out_ptr + i, row, mask=mask)  # the sequence
    tl.store(out_ptr + stride_row + i, row, mask=mask)  # its one token
    tl.store(out_ptr + 2 * stride_row + i, (seq_len - 1).to(tl.int32), mask=mask)  # that token's position
    tl.store(out_ptr + 3 * stride_row + i, tl.full([BLOCK], 1, tl.int32), mask=mask)  # tokens in the block
    tl.store(out_ptr + 4 * stride_row + i, split.to(tl.int32), mask=mask)


def write_decode_table(out: torch.Tensor, seq_lens: torch.Tensor, fixed_split: Optional[int] = None,
                       lanes: int = 1, block_n: int = 1, min_split: int = 0,
                       prefix_lens: Optional[torch.Tensor] = None) -> None:
    """out int32 [5, >= bs] (last dim contiguous), seq_lens [bs] -> out[:, :bs] = what
    decode_block_table(seq_lens, split) gives, split being `fixed_split` when given, else
    decode_split_lens(seq_lens - prefix_lens, lanes, block_n, min_split)."""
    bs = seq_lens.numel()
    if out.dtype != torch.int32 or out.dim() != 2 or out.shape[0] != 5 or out.shape[1] < bs or out.stride(1) != 1:
        raise ValueError(f"write_decode_table: out must be int32 [5, >= {bs}] with contiguous rows, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if prefix_lens is not None and prefix_lens.numel() != bs:
        raise ValueError(f"write_decode_table: {prefix_lens.numel()} prefix lengths for {bs} sequences")
    if bs == 0:
        return
    fixed = fixed_split is not None
    seq_lens = seq_lens.contiguous()
    prefix_lens = prefix_lens.contiguous() if prefix_lens is not None else None
    _decode_table_kernel[(triton.cdiv(bs, BLOCK),)](
        seq_lens, prefix_lens if prefix_lens is not None else seq_lens, out, out.stride(0), bs,
        int(fixed_split) if fixed else 0, int(lanes), int(block_n), int(min_split),
        FIXED=fixed, HAS_PREFIX=prefix_lens is not None and not fixed, BLOCK=BLOCK, num_warps=4)
