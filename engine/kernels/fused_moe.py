"""fused_moe: a mixture-of-experts MLP over routed tokens, and its torch reference.

    out[t] = sum_{k=0..K-1} topk_weights[t, k] * (silu(h_t @ gate_e.T) * (h_t @ up_e.T)) @ w2[e].T
    with e = topk_ids[t, k], w13[e] = [gate_e (rows 0..I); up_e (rows I..2I)]

fused_moe runs the Triton path (moe_gemm.py: align, gate_up + SiLU-and-mul, down, fixed-order
combine): CUDA-graph capturable (no host sync, buffer sizes bounded on the host), deterministic,
and with deterministic=True batch invariant (a token's bits do not depend on the other tokens or
on how many share its experts). fused_moe_reference is the same arithmetic in torch (fp32
accumulation, the kernel's roundings to the input dtype, k summed in order; deterministic=True
batch invariant on the CPU): the CPU path, the backward, and the tests' oracle. This module imports only torch; triton is imported on first use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import batch_invariant as bi
from engine.kernels.torch_backward import needs_grad, reference_grads


def _check(hidden, w13, w2, topk_weights, topk_ids) -> None:
    T, H = hidden.shape
    E, two_i, h13 = w13.shape
    if two_i % 2 or h13 != H or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"fused_moe: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)} "
                         f"(want [E, 2I, H]) and w2 {tuple(w2.shape)} (want [E, H, I]) do not agree")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={T}, K]")
    if topk_ids.dtype.is_floating_point or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"fused_moe: dtypes hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}, "
                         f"topk_ids {topk_ids.dtype} (want one float dtype and integer ids)")


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """The formula in torch, float32 accumulation, rounded to hidden's dtype where the kernels
    round (gate/up, silu, act, each expert output, the sum); differentiable. Syncs the host.
    deterministic: batch invariant on the CPU too (bi.linear's fixed-shape row tiles; silu as
    x / (1 + exp(-x)), since F.silu's vector body and tail round differently: batch_invariant.ops)."""
    dt, (T, H), top_k, I = hidden.dtype, hidden.shape, topk_ids.shape[1], w2.shape[2]
    if deterministic:
        linear, silu = bi.linear, lambda g: g / (1.0 + torch.exp(-g))
    else:
        linear, silu = F.linear, F.silu
    x = hidden.float()
    y = torch.zeros(T, top_k, H, dtype=torch.float32, device=hidden.device)
    for e in topk_ids.unique().tolist():
        tokens, ks = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = _round(linear(x[tokens], w13[e].float()), dt)
        act = _round(_round(silu(gate_up[:, :I]), dt) * gate_up[:, I:], dt)
        y = y.index_put((tokens, ks), _round(linear(act, w2[e].float()), dt))
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    for k in range(top_k):
        out = out + topk_weights[:, k, None].float() * y[:, k]
    return out.to(dt)


def _launch(hidden, w13, w2, topk_weights, topk_ids, deterministic: bool) -> torch.Tensor:
    from engine.kernels.moe_gemm import fused_moe_triton, moe_tile_config

    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    cfg = moe_tile_config(hidden.shape[0], w13.shape[0], topk_ids.shape[1], deterministic)
    return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, cfg)


class _FusedMoe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, w13, w2, topk_weights, topk_ids, deterministic):
        ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids)
        return _launch(hidden, w13, w2, topk_weights, topk_ids, deterministic)

    @staticmethod
    def backward(ctx, grad):
        *floats, topk_ids = ctx.saved_tensors
        grads = reference_grads(lambda h, a, b, w: fused_moe_reference(h, a, b, w, topk_ids), floats,
                                ctx.needs_input_grad[:4], (grad,))
        return (*grads, None, None)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] (float32), topk_ids [T, K]
    (int32, in [0, E)) -> out [T, H] in hidden's dtype, through the Triton kernels (CUDA, or
    TRITON_INTERPRET=1). Ids outside [0, E) give undefined rows (checking them would sync)."""
    _check(hidden, w13, w2, topk_weights, topk_ids)
    if needs_grad(hidden, w13, w2, topk_weights):
        return _FusedMoe.apply(hidden, w13, w2, topk_weights, topk_ids, deterministic)
    return _launch(hidden, w13, w2, topk_weights, topk_ids, deterministic)
