"""Phase A of shared-prefix (cascade) decode: many rows' queries against one prefix's K/V.

A block is up to BLOCK_T decode rows that share keys [0, P) of one sequence's slots (the radix
cache gave them the same slots; engine/attention/shared_prefix.py finds them). Its tile packs
those rows' query heads of one kv head (row m = t * G_PAD + g), so each K/V block of the prefix
is loaded once for all of them, where plain decode loads it once per row. The program stores the
unnormalised partial (max, sum-exp, acc; log2 units) per (row, head); phase B, the split-KV
kernel, starts each row's running softmax from it and reduces the row's own keys [P, len).

Imports triton: import this module only where the triton backend is in use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import env_choice
from engine.kernels.split_kv_attention import _LOG2E, _next_pow2, _split_partial
from engine.kernels.split_kv_tile import Tile

# rows of the int32 block table [4, stride] (SharedPrefixPlan.packed)
PB_START = tl.constexpr(0)  # first index into Rows
PB_COUNT = tl.constexpr(1)  # member rows (0: an unused column)
PB_SEQ = tl.constexpr(2)  # a member's batch row: its req_to_token row holds the prefix's slots
PB_LEN = tl.constexpr(3)  # shared keys
# Programs per kv head, each taking every MAX_PROGRAMS-th block: a CUDA graph's table has a column
# per batch row, mostly empty (a graph of 256 rows launched 2048 programs a layer to read a count
# of 0 each when the batch shared nothing); 32 a head still fill the GPU when groups do share.
# TANDEM_PHASE_A_PROGRAMS=0: a program per block (the launch before; A/B).
MAX_PROGRAMS = int(env_choice("TANDEM_PHASE_A_PROGRAMS", "32", ("0", "8", "16", "32", "64"),
                              "32 (the default), 8, 16, 64, or 0 (a program per block)")) or 1 << 30


def shared_prefix_partials(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           blocks: torch.Tensor, num_blocks: int, rows: torch.Tensor,
                           part_ml: torch.Tensor, part_acc: torch.Tensor, scaling: float,
                           tile: Tile) -> None:
    """part_ml [bs, H, 2] / part_acc [bs, H, D] (float32) of every member row, over its group's
    shared keys. q [bs, H, D]: one decode token per batch row."""
    if num_blocks == 0:
        return
    _, num_heads, head_dim = q.shape
    cfg = tile.config
    shared_prefix_kernel[(min(num_blocks, MAX_PROGRAMS), k_buf.shape[1])](
        q, k_buf, v_buf, part_ml, part_acc, req_to_token, req_pool_indices, blocks, rows,
        num_blocks, blocks.stride(0), q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0), num_heads, scaling * _LOG2E,
        GROUP=tile.group, G_PAD=tile.g_pad, BLOCK_T=tile.block_t, BLOCK_N=tile.block_n,
        BLOCK_D=_next_pow2(max(head_dim, 16)), HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@triton.jit(do_not_specialize=["num_blocks", "blk_stride", "num_heads"])
def shared_prefix_kernel(
    Q, K, V, PartML, PartAcc, ReqToToken, ReqPoolIdx, Blocks, Rows,
    num_blocks, blk_stride, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    num_heads, qk_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grid (<= MAX_PROGRAMS, kv heads): program p takes blocks p, p + programs, ...; a block of
    0 members (CUDA-graph padding) is skipped."""
    kvh = tl.program_id(1)
    for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        count = tl.load(Blocks + PB_COUNT * blk_stride + blk)
        if count > 0:
            _block_partials(Q, K, V, PartML, PartAcc, ReqToToken, ReqPoolIdx, Blocks, Rows, blk, kvh, count,
                            blk_stride, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_r2t, num_heads, qk_scale, GROUP, G_PAD, BLOCK_T, BLOCK_N, BLOCK_D, HEAD_DIM,
                            DOT_PRECISION)


@triton.jit
def _block_partials(Q, K, V, PartML, PartAcc, ReqToToken, ReqPoolIdx, Blocks, Rows, blk, kvh, count,
                    blk_stride, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
                    num_heads, qk_scale, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One block's member rows x one kv head's query heads against the block's shared keys."""
    start = tl.load(Blocks + PB_START * blk_stride + blk)
    seq = tl.load(Blocks + PB_SEQ * blk_stride + blk)
    length = tl.load(Blocks + PB_LEN * blk_stride + blk)
    slots_row = ReqToToken + tl.load(ReqPoolIdx + seq).to(tl.int64) * stride_r2t

    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    offs_m = tl.arange(0, BLOCK_M)
    t = offs_m // G_PAD
    g = offs_m % G_PAD
    row_ok = (t < count) & (g < GROUP)
    tok = tl.load(Rows + start + tl.minimum(t, count - 1)).to(tl.int64)
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.zeros([BLOCK_M], tl.int32) + (length - 1)  # every shared key is visible to every row
    m, l, acc = _split_partial(q, K, V, slots_row, kvh, pos, 0, length, stride_kt, stride_kh,
                               stride_vt, stride_vh, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D,
                               HEAD_DIM, DOT_PRECISION)
    part = tok * num_heads + head
    tl.store(PartML + part * 2, m, mask=row_ok)
    tl.store(PartML + part * 2 + 1, l, mask=row_ok)
    tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=row_ok[:, None] & d_ok[None, :])
