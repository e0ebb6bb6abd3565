"""small_m_glu: silu(x @ W_gate^T) * (x @ W_up^T) for a small decode batch, in one launch.

At batch 1 a decode layer is a chain of ~10 launches whose count, more than their bytes, sets its
time (engine/kernels/pdl.py). Under TANDEM_PDL=wide gate_up already runs on the small-M gemv with
no K split (engine/kernels/small_m_linear.py: `wide_config`), so each program ends holding finished
outputs: here a program takes BLOCK_N columns of gate and the same columns of up (W's rows j and
I + j), and its epilogue writes silu(gate) * up, so silu_and_mul's launch and its [M, 2I] round trip
go. Same bits as the two launches it replaces: the same k steps accumulate each output, gate and up
are rounded to the model's dtype as the gemv stores them, and the activation is silu_and_mul's own
(`silu_mul`, normal mode's rounding, fp contraction off as that kernel compiles).

TANDEM_GLU_EPILOGUE=0 turns it off (A/B). Normal mode only, like the gemv it extends.
Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import env_choice
from engine.kernels.batch_invariant.triton_matmul import interpreting
from engine.kernels.pdl import await_inputs, launch_options, use_pdl
from engine.kernels.silu_and_mul import silu_mul
from engine.kernels import small_m_linear as gemv
from engine.kernels.small_m_linear import MAX_M, GemvConfig, _num_sms, _w_tile, _x_tile, applies, wide_config

ENABLED = env_choice("TANDEM_GLU_EPILOGUE", "1", ("1", "0"), "1 (on, the default) or 0 (off)") == "1"


def glu_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_m_glu may replace gate_up's gemv and the activation: the gemv would take the
    wide weight (engine/kernels/small_m_linear.applies), the weight is gate | up, and down_proj's
    gemv does not take the activation itself (TANDEM_SMALL_M_EPILOGUE=1's prologue)."""
    return ENABLED and not gemv.GATED_PROLOGUE and weight.shape[0] % 2 == 0 and applies(x, weight, wide=True)


def glu_config(intermediate: int, num_sms: int) -> GemvConfig:
    """The gemv's wide tile for the stacked 2I rows, halved: as many programs, each streaming its
    columns of gate and of up."""
    wide = wide_config(2 * intermediate, num_sms)
    return GemvConfig(wide.block_n // 2, wide.block_k, 1, wide.num_warps, wide.num_stages)


@triton.jit
def _glu_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, I, K, stride_xm, stride_wn, stride_om,
                     K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_m = tl.arange(0, 16)  # x's rows padded to 16 for tl.dot
    m_mask = offs_m < M
    up_ptr = w_ptr + I * stride_wn
    gate = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if PDL:  # the first weight tiles stream in while the previous kernel finishes (no kernel writes weights in a step)
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w_gate = _w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)
        w_up = _w_tile(up_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)
        await_inputs(PDL)
        x = _x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, False)
        gate += tl.dot(x, tl.trans(w_gate))
        up += tl.dot(x, tl.trans(w_up))
    for kk in range(BLOCK_K if PDL else 0, K_PAD, BLOCK_K):
        offs_k = kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, False)
        gate += tl.dot(x, tl.trans(_w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)))
        up += tl.dot(x, tl.trans(_w_tile(up_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)))
    if HAS_BIAS:
        gate += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    # rounded by the same cast as the gemv's store, then silu_and_mul's arithmetic
    h = silu_mul(gate.to(dt).to(tl.float32), up.to(dt).to(tl.float32), dt, False, INTERPRET)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], h.to(dt),
             mask=m_mask[:, None] & n_mask[None, :])


def small_m_glu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                config: Optional[GemvConfig] = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, last dim contiguous), weight [2I, K] (gate rows, then up rows), bias
    [2I] or None -> silu(gate) * up [M, I] in x's dtype: silu_and_mul(small_m_linear(x, weight, bias))."""
    M, K = x.shape
    if weight.shape[0] % 2 or weight.shape[1] != K or M > MAX_M or x.stride(-1) != 1:
        raise ValueError(f"small_m_glu: x {tuple(x.shape)} by weight {tuple(weight.shape)} (gate | up rows, "
                         f"at most {MAX_M} rows of x)")
    inter = weight.shape[0] // 2
    out = torch.empty((M, inter), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = config or glu_config(inter, _num_sms(x.device))
    pdl = use_pdl(M, x.device)
    _glu_gemv_kernel[(triton.cdiv(inter, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, M, inter, K, x.stride(0), weight.stride(0),
        out.stride(0), K_PAD=triton.cdiv(K, cfg.block_k) * cfg.block_k, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INTERPRET=interpreting(), PDL=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False, **launch_options(pdl))
    return out
