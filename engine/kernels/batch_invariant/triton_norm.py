"""Batch-invariant RMSNorm (optionally fused with the residual add) and log_softmax in Triton
(and greedy decoding's argmax with its log_softmax value, from the same reduction).

One program reduces one row, over fixed BLOCK-wide chunks in ascending order into per-lane fp32
accumulators, then one tree reduction whose shape depends on (BLOCK, num_warps) only. Both are
functions of the row length (H or V), never of the number of rows, so a row's bits do not
depend on the batch. All arithmetic is done in fp32; values are only rounded to the model dtype
where the model itself rounds (the residual sum, and the normalized value before the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.first_max import NO_INDEX, first_max
from engine.kernels.pdl import await_inputs, launch_options, use_pdl

_MAX_BLOCK = 8192  # an RMSNorm row up to this long is read once and kept in registers
_SOFTMAX_BLOCK = 4096  # log_softmax chunk width


def softmax_launch(V: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a log_softmax row of V: the reduction's shape, so its bits."""
    block = min(triton.next_power_of_2(max(V, 16)), _SOFTMAX_BLOCK)
    return block, max(1, min(16, block // 256))


def _norm_launch(n: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(n, 16)), _MAX_BLOCK)
    return block, max(1, min(16, block // 256))


@triton.jit
def _residual_row(x_ptr, r_ptr, cols, mask, HAS_RES: tl.constexpr):
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # x + residual is rounded to the model dtype, as a plain `x + residual` in that dtype is
        x = (x + r).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, H, stride_x, stride_r, stride_o,
                     stride_ro, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, H, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < H
        z = _residual_row(x_row, r_row, cols, mask, HAS_RES)
        if HAS_RES:
            tl.store(res_out_ptr + row * stride_ro + cols, z.to(res_out_ptr.dtype.element_ty), mask=mask)
        acc += z * z
    inv = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for off in range(0, H, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < H
        # Recomputed rather than re-read: same inputs, same ops, same bits (one pass when H <= BLOCK
        # lets the compiler keep the row in registers).
        z = _residual_row(x_row, r_row, cols, mask, HAS_RES)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # HF/vLLM order: normalize in fp32, round to the model dtype, then multiply by the weight
        y = (z * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_lanes_step(m, s, x):
    """Fold a BLOCK of a row into per-lane (max, sum of exp(x - max)): one read for both, online
    rescaling. engine/kernels/gumbel_sample.py folds with it too, for the same bits."""
    m_new = tl.maximum(m, x)
    # a lane that has only seen -inf rescales against 0, keeping s = 0 instead of NaN
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    return m_new, s * tl.exp(m - m_ref) + tl.exp(x - m_ref)


@triton.jit
def softmax_lanes_finish(m, s):
    """The lanes combined once: (the row's max, log of its sum of exp(x - max))."""
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(s * tl.exp(m - m_row), axis=0)  # an all -inf row gives NaN, as torch does
    return m_row, tl.log(s_row)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m, s = softmax_lanes_step(m, s, tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32))
    m_row, log_z = softmax_lanes_finish(m, s)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (x - m_row) - log_z, mask=mask)


@triton.jit
def _greedy_log_softmax_kernel(x_ptr, ids_ptr, logprob_ptr, V, stride_x, BLOCK: tl.constexpr):
    """_log_softmax_kernel's first pass (the same lanes, so the same max and log_z) plus each
    lane's first maximum; one value written a row: log_softmax's entry at the argmax."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_i = tl.full((BLOCK,), NO_INDEX, dtype=tl.int32)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, s = softmax_lanes_step(m, s, x)
        # a lane keeps its first maximum (later columns win only if larger) and its first NaN
        take = (cols < V) & ((x > best) | ((x != x) & (best == best)) | (best_i == NO_INDEX))
        best, best_i = tl.where(take, x, best), tl.where(take, cols, best_i)
    m_row, log_z = softmax_lanes_finish(m, s)
    top, idx = first_max(best, best_i)
    tl.store(ids_ptr + row, idx.to(tl.int64))
    tl.store(logprob_ptr + row, (top - m_row) - log_z)  # (x - max) - log_z, as log_softmax writes it


def greedy_log_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] float32 -> (argmax ids int64 [N], log_softmax(x)[row, id] float32 [N]): the first
    index on ties, a NaN first, as torch.argmax; the logprob bit for bit log_softmax's (same
    launch shape), without writing [N, V]."""
    if x.dtype != torch.float32:
        raise TypeError(f"greedy_log_softmax takes float32 (log_softmax's lanes follow the element width), got {x.dtype}")
    x2 = _rows(x)
    M, V = x2.shape
    ids = torch.empty(M, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        block, warps = softmax_launch(V)
        _greedy_log_softmax_kernel[(M,)](x2, ids, logprobs, V, x2.stride(0), BLOCK=block, num_warps=warps)
    return ids, logprobs


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D view with a unit last stride (rows may be strided)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """out = rmsnorm(x [+ residual]) * weight; with residual returns (out, x + residual)."""
    shape = x.shape
    x2 = _rows(x)
    M, H = x2.shape
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty((M, H), dtype=x.dtype, device=x.device) if residual is not None else out
    if M:
        block, warps = _norm_launch(H)
        pdl = use_pdl(M, x.device)
        _rms_norm_kernel[(M,)](x2, r2, weight.contiguous(), out, res_out, H, x2.stride(0), r2.stride(0),
                               out.stride(0), res_out.stride(0), float(eps), HAS_RES=residual is not None,
                               BLOCK=block, PDL=pdl, num_warps=warps, **launch_options(pdl))
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the last dim."""
    shape = x.shape
    x2 = _rows(x)
    M, V = x2.shape
    out = torch.empty((M, V), dtype=torch.float32, device=x.device)
    if M:
        block, warps = softmax_launch(V)
        _log_softmax_kernel[(M,)](x2, out, V, x2.stride(0), out.stride(0), BLOCK=block, num_warps=warps)
    return out.view(shape)
