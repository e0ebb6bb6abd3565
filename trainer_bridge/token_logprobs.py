"""token_logprobs: log p(target) of each row through the LM head, without the [rows, vocab] logits.

A normal-mode trainer's step needs one logprob per response token, yet `log_softmax` over the
full vocabulary keeps float32 logits, their log_softmax and its gradient alive: 3 x 5 GB for the
qwen3_gpu recipe's micro batch of 32 (8,192 rows x 151,936 words). Here the head runs in chunks of
rows; forward keeps each row's logsumexp, backward recomputes the chunk's logits and forms
d logits = grad x (onehot(target) - softmax) in place (the fused linear cross-entropy of Liger
Kernel and Apple's cut-cross-entropy, for a logprob instead of a mean loss). Deterministic mode
keeps the batch-invariant head and log_softmax (the engine's bits), by chunks recomputed in the
backward (`recomputed_logprobs`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ROWS = 2048  # 1.2 GB of float32 logits a chunk at a 151,936-word vocabulary


def recomputed_logprobs(hidden: torch.Tensor, targets: torch.Tensor,
                        row_logprobs: Callable[[torch.Tensor], torch.Tensor], recompute: bool = True) -> torch.Tensor:
    """float32 [N]: row_logprobs(hidden)[i, targets[i]], by chunks of CHUNK_ROWS rows whose
    [rows, vocab] logprobs are recomputed in the backward (activation checkpointing), not kept:
    deterministic mode's head and log_softmax, which have no fused logprob kernel. Those kernels
    are row-wise (batch-invariant), so each value has the whole batch's bits; the head's weight
    gradient is summed chunk by chunk (the same order every run). Kept, a micro batch of 32
    16k-token rollouts held 3 x 311 GB. recompute=False: chunks kept for the backward (a head
    whose weight ZeRO-3 gathers only inside its own forward)."""
    def picked(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return row_logprobs(h).gather(1, t[:, None])[:, 0]

    if len(hidden) <= CHUNK_ROWS:
        return picked(hidden, targets)
    recompute = recompute and torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, len(hidden), CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        parts.append(checkpoint(picked, hidden[rows], targets[rows], use_reentrant=False) if recompute
                     else picked(hidden[rows], targets[rows]))
    return torch.cat(parts)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: Optional[float] = None) -> torch.Tensor:
    """hidden [N, H] (activation dtype), weight [V, H] (the LM head's), targets [N] int64 ->
    float32 [N]: log_softmax(hidden @ weight.T / temperature)[i, targets[i]]."""
    return _LinearLogprob.apply(hidden, weight, targets, temperature)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: Optional[float]) -> torch.Tensor:
    logits = (hidden @ weight.T).float()  # as the model's compute_logits: the head's dtype, then float32
    return logits if temperature is None else logits.div_(temperature)  # a fresh tensor either way


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        out = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, len(hidden), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            logits = _logits(hidden[rows], weight, temperature)
            lse[rows] = torch.logsumexp(logits, -1)
            out[rows] = logits.gather(1, targets[rows, None])[:, 0] - lse[rows]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        d_hidden = torch.empty_like(hidden) if want_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        scale = 1.0 if ctx.temperature is None else 1.0 / ctx.temperature
        for start in range(0, len(hidden), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            g = grad[rows, None].float() * scale  # d logit / d (hidden @ weight.T) = 1 / temperature
            d_logits = _logits(hidden[rows], weight, ctx.temperature).sub_(lse[rows, None]).exp_().mul_(-g)
            d_logits = d_logits.scatter_add_(1, targets[rows, None], g).to(hidden.dtype)  # onehot - softmax
            if want_hidden:
                d_hidden[rows] = d_logits @ weight
            if want_weight:
                d_weight += (d_logits.T @ hidden[rows]).float()
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None
