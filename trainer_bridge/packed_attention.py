"""Attention over packed whole sequences for the trainer: no KV pool, K/V used as computed.

The decoder's attention layers call `forward_batch.attn_backend.forward(...)`; the trainer passes
a `PackedBatch` whose backend is `PackedAttention`, so the same model classes run a trainer-style
full-sequence forward. Every sequence goes through `split_kv_attention`, the function the engine's
torch backend runs in deterministic mode, so a token's attention output is the same bits here as
when the engine prefilled or decoded it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.attention.deterministic import split_kv_attention


class PackedAttention(AttentionBackend):
    """split_size must equal the engine backend's (TorchNativeAttentionBackend's default is 64)."""

    def __init__(self, split_size: int = 64) -> None:
        self.split_size = split_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, forward_batch: "PackedBatch") -> torch.Tensor:
        outs = []
        start = 0
        for n in forward_batch.seq_lens_cpu:
            end = start + n
            positions = torch.arange(n, device=q.device)
            outs.append(split_kv_attention(q[start:end], k[start:end], v[start:end], positions,
                                           scaling, self.split_size))
            start = end
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.to(q.dtype)


@dataclass
class PackedBatch:
    """What the model reads from a forward batch when sequences are whole and packed back to back."""

    seq_lens_cpu: list[int]
    attn_backend: PackedAttention

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
