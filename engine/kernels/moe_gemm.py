"""The fused MoE's Triton launches: grouped gate_up GEMM (+ SiLU-and-mul), grouped down GEMM, and
the weighted top-k combine. fused_moe.py holds the interface and the torch reference.

  align      moe_align: entries t*K + k sorted by expert, BLOCK_M-padded (moe_align.py)
  gate_up    per BLOCK_M block of one expert: rows hidden[t] @ w13[e].T, gate and up tiles side by
             side (two fp32 accumulators over the full H, ascending k), then silu(gate) * up with
             silu_and_mul's rounding -> act [T*K, I] at the entry's row
  down       act[i] @ w2[e].T over the full I -> y [T*K, H] at the entry's row, unweighted
  combine    out[t] = sum_k topk_weights[t, k] * y[t*K + k] in fp32, k = 0..K-1 in order

Why a token's bits do not depend on the batch in deterministic mode: every output element is one
program's fp32 accumulation over the whole reduction in ascending BLOCK_K steps (no split-K, no
atomics), with one fixed tile config; the rows of an MMA are independent, so where a row sits in
its block and what else (or padding) shares the block changes nothing; the combine reads the K
results in a fixed order. Normal mode may pick the tile by T (CONFIGS), so its bits may change
with the batch size, never between runs of one shape.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.batch_invariant.triton_matmul import _tile_coords, interpreting
from engine.kernels.moe_align import moe_align
from engine.kernels.qk_norm_rope import round_to
from engine.kernels.silu_and_mul import silu_mul


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Normal mode, by routed rows per expert (T*K/E): decode is weight-bandwidth bound (small BLOCK_M,
# narrow N tiles so there are enough programs to pull the weights), prefill is MMA bound.
# Starting points for the H200 at the Qwen3-30B-A3B shape, not yet tuned there.
CONFIGS = (
    (4, MoeTileConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (32, MoeTileConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)),
    (None, MoeTileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
)
# Deterministic mode: one config for every T, so no row's arithmetic depends on the batch.
DETERMINISTIC_CONFIG = MoeTileConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)


def moe_tile_config(num_tokens: int, num_experts: int, top_k: int, deterministic: bool) -> MoeTileConfig:
    if deterministic:
        return DETERMINISTIC_CONFIG
    rows_per_expert = num_tokens * top_k / num_experts
    return next(cfg for limit, cfg in CONFIGS if limit is None or rows_per_expert <= limit)


# The token-count arguments are not specialized (divisible by 16, equal to 1): one binary per
# config serves every T, so no batch size compiles anew (e.g. at CUDA-graph capture) or runs other code.
@triton.jit(do_not_specialize=["num_rows", "n_blocks_m"])
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, total_ptr, scale_ptr,
                        N, K, num_rows, n_blocks_m, stride_am, stride_we, stride_wn, stride_om,
                        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ADD_SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """out[row, n] = a[row // A_ROW_DIV] . w[expert, n] for the rows of one block; GATED: also the
    up half w[expert, N + n] and out = silu(gate) * up; ADD_SCALED (LoRA's expand): out[row, n] +=
    scale[expert] * that product, each step rounded as torch rounds it."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), n_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows  # padding rows hold the sentinel num_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    up_shift = N * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask, w_mask = row_ok[:, None], n_ok[None, :]
        else:
            k_ok = offs_k + k < K
            a_mask, w_mask = row_ok[:, None] & k_ok[None, :], n_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(w_ptrs + up_shift, mask=w_mask, other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    if GATED:
        res = silu_mul(round_to(acc, dt), round_to(acc_up, dt), dt, False, INTERPRET)
    else:
        res = round_to(acc, dt)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if ADD_SCALED:
        res = round_to(res * tl.load(scale_ptr + expert), dt)
        res = round_to(tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + res, dt)
    tl.store(out_ptrs, res.to(dt), mask=out_mask)


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        weight = tl.load(weights_ptr + token * TOP_K + k)
        acc += weight * tl.load(y_ptr + (token * TOP_K + k) * H + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * H + cols, round_to(acc, dt).to(dt), mask=mask)


def expert_gemm(a, w, out, align, num_rows, a_row_div, gated, cfg: MoeTileConfig, add_scaled=None):
    """add_scaled: None, or float32 [E]: out += add_scaled[expert] * product (in place)."""
    n_out = out.shape[1]
    k_dim = a.shape[1]
    n_blocks_m = align.expert_ids.numel()
    grid = (n_blocks_m * triton.cdiv(n_out, cfg.block_n),)
    _expert_gemm_kernel[grid](
        a, w, out, align.sorted_ids, align.expert_ids, align.total,
        align.total if add_scaled is None else add_scaled, n_out, k_dim, num_rows, n_blocks_m,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), A_ROW_DIV=a_row_div, GATED=gated,
        ADD_SCALED=add_scaled is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k_dim % cfg.block_k == 0, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, cfg: MoeTileConfig) -> torch.Tensor:
    """The four launches (module docstring); shapes already checked by fused_moe. No host sync."""
    T, H = hidden.shape
    E, I, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    hidden, w13, w2 = (x if x.stride(-1) == 1 else x.contiguous() for x in (hidden, w13, w2))
    align = moe_align(topk_ids, E, cfg.block_m)
    act = torch.empty(T * top_k, I, dtype=hidden.dtype, device=hidden.device)
    expert_gemm(hidden, w13, act, align, T * top_k, top_k, True, cfg)
    y = torch.empty(T * top_k, H, dtype=hidden.dtype, device=hidden.device)
    expert_gemm(act, w2, y, align, T * top_k, 1, False, cfg)
    out = torch.empty_like(hidden)
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](
        y, topk_weights.to(torch.float32).contiguous(), out, H, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out
