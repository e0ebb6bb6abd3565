"""causal_attention_grads: the deterministic trainer's attention backward in bounded memory.

PackedAttention's Triton forward has no backward of its own; its gradients are those of plain
causal attention in float32 (`causal_attention`, SDPA's math backend: the same gradients run
after run). That backend keeps heads x n^2 float32 scores, probabilities and their gradients for a
sequence of n tokens: at n = 16k and 32 heads, over 100 GiB. So gradients are taken run by run
(the runs `causal_attention` batches), and a sequence too long for one run is split into blocks of
query rows, each attending to its keys so far and backpropagated before the next: no SDPA holds
more than MAX_SCORES score entries.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from engine.kernels.torch_backward import reference_grads
from trainer_bridge import packed_attention
from trainer_bridge.packed_attention import causal_attention

Grads = tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


def causal_attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                           scaling: float, grad: torch.Tensor, needs: Sequence[bool]) -> Grads:
    """(dq, dk, dv) of causal_attention(q, k, v, seq_lens, scaling) under the output gradient
    `grad`; None where `needs` is false."""
    lens = list(seq_lens)
    out = [torch.zeros_like(t) if n else None for t, n in zip((q, k, v), needs)]
    start = 0
    for first, last in packed_attention._runs(lens, q.shape[1]):
        rows = slice(start, start + sum(lens[first:last]))
        start = rows.stop
        if last - first == 1 and q.shape[1] * lens[first] ** 2 > packed_attention.MAX_SCORES:
            _blocked_grads(q[rows], k[rows], v[rows], scaling, grad[rows], [t if t is None else t[rows] for t in out])
            continue
        run = lens[first:last]
        grads = reference_grads(lambda a, b, c: causal_attention(a, b, c, run, scaling),
                                (q[rows], k[rows], v[rows]), needs, (grad[rows],))
        for total, part in zip(out, grads):
            if total is not None:
                total[rows] = part
    return tuple(out)


def _blocked_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, grad: torch.Tensor,
                   out: list[Optional[torch.Tensor]]) -> None:
    """One sequence, query rows in blocks; adds each block's gradients into `out` (views of the totals)."""
    n, heads = q.shape[0], q.shape[1]
    block = max(1, packed_attention.MAX_SCORES // (heads * n))
    needs = [t is not None for t in out]
    for first in range(0, n, block):
        last = min(n, first + block)
        grads = reference_grads(lambda a, b, c: _block_attention(a, b, c, first, scaling),
                                (q[first:last], k[:last], v[:last]), needs, (grad[first:last],))
        for total, part, span in zip(out, grads, (slice(first, last), slice(0, last), slice(0, last))):
            if total is not None:
                total[span] += part


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scaling: float) -> torch.Tensor:
    """Rows offset.. of one sequence's causal attention in float32; q [b, H, D], k / v [offset + b, Hkv, D]."""
    rows = torch.arange(offset, offset + q.shape[0], device=q.device)
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= rows[:, None]  # [b, keys]
    with packed_attention._backend_for(torch.float32):  # as causal_attention's float32: reproducible
        out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=visible,
                                             scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype)
