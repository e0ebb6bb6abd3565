"""Differentiable wrappers of the batch-invariant Triton kernels (the trainer's path on CUDA).

Autograd cannot see into a Triton kernel, so each op is a torch.autograd.Function whose forward
is the Triton kernel (the engine's bits, so a trainer's logprobs equal the rollout's) and whose
backward is plain torch: for linear the usual matmul formulas; for rms_norm and log_softmax the
torch formulation recomputed under enable_grad and backpropagated (or torch's own formula from
the saved output). Gradients need no batch invariance, so they are torch's, not bitwise anything.

`bi_linear`, `bi_rms_norm` and `bi_log_softmax` mirror `triton_ops`' functions of those names;
`ops` calls them only when a gradient is needed (grad mode on and an input requires grad), so
the engine's inference path is unchanged. Importing this module does not import triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.kernels.torch_backward import reference_grads


def _triton():
    from engine.kernels.batch_invariant import triton_ops

    return triton_ops


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _triton().bi_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor]):
        ctx.save_for_backward(x, weight, residual)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # an unused output (e.g. the last residual) costs nothing
        return _triton().bi_rms_norm(x, weight, eps, residual)

    @staticmethod
    def backward(ctx, *grads):
        from engine.kernels.batch_invariant.ops import rms_norm_reference

        x, weight, residual = ctx.saved_tensors
        needs = ctx.needs_input_grad
        gx, gw, gr = reference_grads(lambda a, w, r: rms_norm_reference(a, w, ctx.eps, r),
                                     (x, weight, residual), (needs[0], needs[1], needs[3]), grads)
        return gx, gw, None, gr


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = _triton().bi_log_softmax(x)
        ctx.save_for_backward(out)
        ctx.in_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        # torch's log_softmax backward, from the (float32) output
        return (grad - out.exp() * grad.sum(-1, keepdim=True)).to(ctx.in_dtype)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """triton_ops.bi_linear forward, torch backward."""
    return _Linear.apply(x, weight, bias)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """triton_ops.bi_rms_norm forward (with residual: (norm(x + residual), x + residual)), torch backward."""
    return _RMSNorm.apply(x, weight, eps, residual)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """triton_ops.bi_log_softmax forward (float32 out), torch backward."""
    return _LogSoftmax.apply(x)
