"""Split-KV paged attention: one kernel family for extend (prefill) and decode.

Layout: q [T, H, D]; the pool's K/V [size+1, Hkv, D]; key position `n` of a sequence lives in
slot req_to_token[req_pool_idx, n]. KV of the new tokens is already in the pool (store_kv runs
first), so a query row at absolute position p attends keys 0..p of its sequence, all read the
same way whether they were cached or written a moment ago.

Work unit (stage 1): a q block = up to BLOCK_T consecutive tokens of ONE sequence, aligned at
absolute positions (positions [a*BLOCK_T, (a+1)*BLOCK_T)), times the G query heads of one kv head
(GQA packing: tile row m = t * G_PAD + g, so K/V are loaded once for the whole group). A decode
step is a q block with one valid token. The keys are cut into splits [j*SPLIT, (j+1)*SPLIT) at
absolute positions and each split is reduced by the same BLOCK_N loop from its start, giving a
partial (max, sum-exp, unnormalised acc) in log2 units. Partials are merged in split order
0, 1, 2, ... either inside the program (MERGE) or by stage 2 after stage 1 stored them.

Why a row's result is the same bits in prefill and decode (deterministic mode): BLOCK_N,
BLOCK_D, G_PAD and the warps are one fixed config (prefill's tile may have more rows, BLOCK_T
tokens: 32 rows instead of decode's 16 at the head shapes where that was measured to keep every
row's bits, split_kv_plan.DET_EXTEND_MEASURED; 64 rows or 8 warps change the accumulator layout
and so a row's sums: scripts/det_extend_tile_probe.py); BLOCK_T | BLOCK_N |
SPLIT and q blocks are aligned, so every row of a block ends its keys in the same key block as it
would alone, i.e. the row runs exactly the loop it runs in decode; rows of a tile never mix
(MMA rows and row reductions are independent); the merge is one helper, the same operations in
stage 1 and stage 2. So neither the other rows of the batch, nor the chunking, nor the number of
programs per split (`lanes`), nor MERGE vs stage 2 change any row.

Imports triton: import this module only where the triton backend is in use.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_inputs, launch_options, use_pdl
from engine.kernels.split_kv_tile import Tile

# rows of the int32 block table [5, stride], one column per q block (engine/attention/split_kv_plan.py);
# constexpr because compiled kernels may only read constexpr globals
BLK_SEQ = tl.constexpr(0)  # index into req_pool_indices
BLK_TOK = tl.constexpr(1)  # first q row of the block
BLK_POS = tl.constexpr(2)  # absolute position of that row
BLK_NTOK = tl.constexpr(3)  # valid tokens in the block
BLK_SPLIT = tl.constexpr(4)  # split size in keys


def split_kv_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, blocks: torch.Tensor,
    num_blocks: int, scaling: float, tile: Tile, lanes: int,
    part_acc: Optional[torch.Tensor] = None, part_ml: Optional[torch.Tensor] = None,
    prefix: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> None:
    """out[t] = softmax(q[t] K^T * scaling, causal) V for every token of the block table.
    part_acc None: one program per (q block, kv head) merges its splits; else `lanes` programs
    store per-split partials and stage 2 merges them (one-token blocks only).
    prefix (decode only): (prefix_lens int32 [bs], ml [bs, H, 2], acc [bs, H, D]) from
    shared-prefix phase A; row t then reduces keys [prefix_lens[t], len) only, starting from that
    partial (prefix_lens[t] == 0: from nothing, as without prefix)."""
    if num_blocks == 0:
        return
    if min(q.stride(-1), k_buf.stride(-1), v_buf.stride(-1), out.stride(-1)) != 1:
        raise ValueError("split_kv_attention needs the head_dim axis contiguous")
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    merge = part_acc is None
    cfg = tile.config
    common = dict(GROUP=tile.group, G_PAD=tile.g_pad, BLOCK_D=_next_pow2(max(head_dim, 16)),
                  HEAD_DIM=head_dim)
    max_splits = 0 if merge else part_acc.shape[2]
    part_acc = out if merge else part_acc  # unused pointer when merging in the program
    part_ml = out if merge else part_ml
    prefix_lens, prefix_ml, prefix_acc = prefix if prefix is not None else (blocks, out, out)
    common["PREFIX"] = prefix is not None
    pdl = use_pdl(max(num_blocks, q.shape[0]), q.device)  # decode at small batch: one block per row
    common["PDL"] = pdl
    split_kv_stage1[(num_blocks, num_kv_heads, 1 if merge else lanes)](
        q, k_buf, v_buf, out, part_acc, part_ml, req_to_token, req_pool_indices, blocks,
        prefix_lens, prefix_ml, prefix_acc,
        blocks.stride(0), q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        num_heads, max_splits, scaling * _LOG2E,
        BLOCK_T=tile.block_t, BLOCK_N=tile.block_n, MERGE=merge,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=cfg.fp_fusion,
        **common, **launch_options(pdl),
    )
    if not merge:
        split_kv_stage2[(num_blocks, num_kv_heads)](
            out, part_acc, part_ml, blocks, prefix_lens, prefix_ml, prefix_acc,
            blocks.stride(0), out.stride(0), out.stride(1),
            num_heads, max_splits, num_warps=4, enable_fp_fusion=cfg.fp_fusion, **common, **launch_options(pdl),
        )


_LOG2E = math.log2(math.e)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _merge(M, L, ACC, m, l, acc):
    """Fold partial (m, l, acc) into the running (M, L, ACC); log2 domain. fma written out so
    the compiler has no contraction choice to make differently in stage 1 and stage 2."""
    m_new = tl.maximum(M, m)
    a = tl.exp2(M - m_new)
    b = tl.exp2(m - m_new)
    L = tl.fma(l, b, L * a)
    ACC = tl.fma(acc, b[:, None], ACC * a[:, None])
    return m_new, L, ACC


@triton.jit
def _prefix_partial(PrefixML, PrefixAcc, part, row_ok, key0, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """A row's shared-prefix partial as the running (M, L, ACC); a row without one (key0 == 0)
    starts empty (M = -inf, L = 0, ACC = 0), which _merge folds away exactly."""
    ok = row_ok & ((part * 0 + key0) > 0)  # key0 broadcast first: the interpreter wants a tensor mask
    M = tl.load(PrefixML + part * 2, mask=ok, other=float("-inf"))
    L = tl.load(PrefixML + part * 2 + 1, mask=ok, other=0.0)
    ACC = tl.load(PrefixAcc + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=ok[:, None] & d_ok[None, :], other=0.0)
    return M, L, ACC


@triton.jit
def _split_partial(q, K, V, slots_row, kvh, pos, lo, hi, stride_kt, stride_kh, stride_vt,
                   stride_vh, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   MASK_HI: tl.constexpr = False):
    """Online softmax over keys [lo, hi) for rows at positions pos (causal: key <= pos).
    Keys of the last block past hi are left to the causal mask, which holds them out when
    splits start on key-block boundaries; MASK_HI masks them too (cascade decode's rows start
    their own keys anywhere)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slots = tl.load(slots_row + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASK_HI:
            qk = tl.where((offs_n[None, :] <= pos[:, None]) & n_ok[None, :], qk, float("-inf"))
        else:
            qk = tl.where(offs_n[None, :] <= pos[:, None], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit(do_not_specialize=["blk_stride", "num_heads", "max_splits"])
def split_kv_stage1(
    Q, K, V, Out, PartAcc, PartML, ReqToToken, ReqPoolIdx, Blocks, PrefixLens, PrefixML, PrefixAcc,
    blk_stride, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_r2t, num_heads, max_splits, qk_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFIX: tl.constexpr, PDL: tl.constexpr = False,
):
    """grid (q blocks, kv heads, lanes); lane l reduces splits l, l + lanes, ..."""
    await_inputs(PDL)
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    lane = tl.program_id(2)
    lanes = tl.num_programs(2)
    seq = tl.load(Blocks + BLK_SEQ * blk_stride + blk)
    tok_start = tl.load(Blocks + BLK_TOK * blk_stride + blk)
    pos_start = tl.load(Blocks + BLK_POS * blk_stride + blk)
    ntok = tl.load(Blocks + BLK_NTOK * blk_stride + blk)
    split = tl.load(Blocks + BLK_SPLIT * blk_stride + blk)
    req_row = tl.load(ReqPoolIdx + seq).to(tl.int64)
    slots_row = ReqToToken + req_row * stride_r2t

    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    offs_m = tl.arange(0, BLOCK_M)
    t = offs_m // G_PAD
    g = offs_m % G_PAD
    row_ok = (t < ntok) & (g < GROUP)
    # padding rows repeat the last token's position: finite, never stored
    pos = pos_start + tl.minimum(t, ntok - 1)
    pos_last = pos_start + ntok - 1
    tok = (tok_start + t).to(tl.int64)
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if PREFIX:  # decode after shared-prefix phase A: this row's own keys, from its partial
        key0 = tl.load(PrefixLens + tok_start)
        M, L, ACC = _prefix_partial(PrefixML, PrefixAcc, tok * num_heads + head, row_ok, key0,
                                    offs_d, d_ok, HEAD_DIM)
    else:
        key0 = 0
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        ACC = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    num_splits = (pos_last - key0) // split + 1
    for j in range(lane, num_splits, lanes):
        lo = key0 + j * split
        hi = tl.minimum(lo + split, pos_last + 1)
        m, l, acc = _split_partial(q, K, V, slots_row, kvh, pos, lo, hi, stride_kt, stride_kh,
                                   stride_vt, stride_vh, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D,
                                   HEAD_DIM, DOT_PRECISION, PREFIX)
        if MERGE:
            M, L, ACC = _merge(M, L, ACC, m, l, acc)
        else:
            part = (tok * num_heads + head) * max_splits + j
            tl.store(PartML + part * 2, m, mask=row_ok)
            tl.store(PartML + part * 2 + 1, l, mask=row_ok)
            tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
    if MERGE:
        out = ACC / L[:, None]
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["blk_stride", "num_heads", "max_splits"])
def split_kv_stage2(
    Out, PartAcc, PartML, Blocks, PrefixLens, PrefixML, PrefixAcc, blk_stride, stride_ot,
    stride_oh, num_heads, max_splits,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PREFIX: tl.constexpr, PDL: tl.constexpr = False,
):
    """grid (q blocks of one token each, kv heads): merge the row's splits in order."""
    await_inputs(PDL)
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(Blocks + BLK_TOK * blk_stride + blk).to(tl.int64)
    pos = tl.load(Blocks + BLK_POS * blk_stride + blk)
    split = tl.load(Blocks + BLK_SPLIT * blk_stride + blk)
    g = tl.arange(0, G_PAD)
    ok = g < GROUP
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if PREFIX:
        key0 = tl.load(PrefixLens + tok)
        M, L, ACC = _prefix_partial(PrefixML, PrefixAcc, tok * num_heads + head, ok, key0,
                                    offs_d, d_ok, HEAD_DIM)
    else:
        key0 = 0
        M = tl.full([G_PAD], float("-inf"), tl.float32)
        L = tl.zeros([G_PAD], tl.float32)
        ACC = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for j in range(0, (pos - key0) // split + 1):
        part = (tok * num_heads + head) * max_splits + j
        m = tl.load(PartML + part * 2, mask=ok, other=0.0)
        l = tl.load(PartML + part * 2 + 1, mask=ok, other=1.0)  # padding heads: no 0/0
        acc = tl.load(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=ok[:, None] & d_ok[None, :], other=0.0)
        M, L, ACC = _merge(M, L, ACC, m, l, acc)
    out = ACC / L[:, None]
    tl.store(Out + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
