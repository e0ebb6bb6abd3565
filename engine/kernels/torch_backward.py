"""Backward passes of Triton kernels through their torch reference code.

Autograd cannot see into a Triton kernel, so each differentiable kernel is a
torch.autograd.Function whose forward is the kernel and whose backward recomputes the torch
formulation on the saved inputs and backpropagates it (gradients need no bitwise match).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a call on these tensors (grad mode on, one requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def reference_grads(fn: Callable, inputs: Sequence[Optional[torch.Tensor]], needs: Sequence[bool],
                    grads: Sequence[Optional[torch.Tensor]]) -> tuple[Optional[torch.Tensor], ...]:
    """Gradients of fn(*inputs) (a tensor or a tuple of them, weighted by `grads`; a None grad
    marks an unused output) for the inputs whose `needs` is true; None for the others."""
    leaves = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip(inputs, needs)]
    with torch.enable_grad():
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    wanted = [t for t, n in zip(leaves, needs) if n and t is not None]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                   allow_unused=True) if wanted and pairs else [None] * len(wanted))
    return tuple(next(got) if n and t is not None else None for t, n in zip(leaves, needs))
