"""silu_and_mul: [..., 2d] (gate | up) -> silu(gate) * up in one launch.

Replaces on CUDA the 2 torch launches of F.silu(gate) * up, or the 5 of the batch-invariant
formula gate / (1 + exp(-gate)) * up (neg, exp, add, div, mul). Elementwise, so batch-invariant.
Two roundings, each bitwise equal to its torch code:
  stepwise=True   bi.silu_and_mul: every op's result rounded to the dtype, as 5 torch ops round
  stepwise=False  F.silu(gate) * up: CUDA's silu works in fp32 and rounds once, then the mul
Same arithmetic as torch's CUDA kernels: exp is libdevice's expf, CUDA's expf algorithm (tl.exp
is a bare ex2.approx), division is IEEE div.rn (tl's `/` is div.full), fp contraction off.
Triton links libdevice flush-to-zero, which only changes denormal exp inputs/results; neither
reaches the output (exp(tiny) = 1; 1 + denormal rounds to 1). The interpreter has no libdevice
and uses numpy's exp, which can differ from torch's CPU exp by an ulp.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.batch_invariant.triton_matmul import interpreting
from engine.kernels.pdl import await_inputs, launch_options, use_pdl
from engine.kernels.qk_norm_rope import round_to
from engine.kernels.torch_backward import needs_grad, reference_grads

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr, STEPWISE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 gate, up (each already a dt value) -> silu(gate) * up, rounded as the module docstring
    says, as fp32 holding a dt value. Also the fused MoE's gate_up epilogue."""
    if INTERPRET:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    if STEPWISE:
        e = round_to(e, dt)
        silu = round_to(tl.math.div_rn(gate, round_to(1.0 + e, dt)), dt)
    else:
        silu = round_to(tl.math.div_rn(gate, 1.0 + e), dt)
    return round_to(silu * up, dt)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, STEPWISE: tl.constexpr,
                         INTERPRET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, dt, STEPWISE, INTERPRET).to(dt), mask=mask)


def _launch(x: torch.Tensor, stepwise: bool) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate | up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(_BLOCK, triton.next_power_of_2(d))
        pdl = use_pdl(rows.shape[0], x.device)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, d, rows.stride(0), out.stride(0), STEPWISE=stepwise, INTERPRET=interpreting(),
            BLOCK=block, PDL=pdl, num_warps=4, enable_fp_fusion=False, **launch_options(pdl))
    return out.view(*x.shape[:-1], d)


def silu_and_mul_reference(x: torch.Tensor, stepwise: bool = True) -> torch.Tensor:
    """The torch code each mode reproduces; its autograd is the backward."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if stepwise:
        return gate / (1.0 + torch.exp(-gate)) * up
    return F.silu(gate) * up


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stepwise):
        ctx.save_for_backward(x)
        ctx.stepwise = stepwise
        return _launch(x, stepwise)

    @staticmethod
    def backward(ctx, grad):
        (gx,) = reference_grads(lambda x: silu_and_mul_reference(x, ctx.stepwise), ctx.saved_tensors,
                                (True,), (grad,))
        return gx, None


def silu_and_mul(x: torch.Tensor, stepwise: bool = True) -> torch.Tensor:
    """[..., 2d] (gate | up) -> [..., d]; stepwise picks the rounding (module docstring)."""
    if needs_grad(x):
        return _SiluAndMul.apply(x, stepwise)
    return _launch(x, stepwise)
