"""VarlenAttention: the normal-mode trainer's attention, flash attention forward and backward.

A normal-mode trainer needs no engine bits (its engine's rollouts are not batch-invariant either),
so causal attention over its packed whole sequences is torch's flash-attention varlen kernel in
the activation dtype, forward and backward (`torch.nn.attention.varlen.varlen_attn`, CUDA): one
launch per layer and pass. PackedAttention instead runs the engine's deterministic kernel and a
float32 backward (the recipe's train step spent 3.9 of its 4.5 s of host time in that backward,
H200 profile, scripts/train_step_profile.py). Where flash attention is not there (the CPU, a
float32 model, a torch without varlen) the sequences go through `causal_attention`, which
right-pads them into batched SDPA.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

from engine.attention.base import AttentionBackend
from trainer_bridge.packed_attention import PackedBatch, causal_attention

FLASH_DTYPES = (torch.float16, torch.bfloat16)


class VarlenAttention(AttentionBackend):
    """Causal attention of each packed sequence; differentiable, not batch-invariant."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, forward_batch: PackedBatch) -> torch.Tensor:
        varlen = _varlen_attn()
        if varlen is None or not q.is_cuda or q.dtype not in FLASH_DTYPES:
            return causal_attention(q, k, v, forward_batch.seq_lens_cpu, scaling, dtype=q.dtype)
        cu_lens, max_len = forward_batch.cumulative_lens(q.device)
        gqa = {"enable_gqa": True} if _takes_gqa() else {}
        if not gqa:  # torch < 2.13: every query head gets its own K/V rows
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen(q, k, v, cu_lens, cu_lens, max_len, max_len, scale=scaling, window_size=(-1, 0), **gqa)


@functools.lru_cache(maxsize=None)
def _varlen_attn() -> Optional[callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "window_size" not in inspect.signature(varlen_attn).parameters:  # no causal mask to ask for
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _takes_gqa() -> bool:
    fn = _varlen_attn()
    return fn is not None and "enable_gqa" in inspect.signature(fn).parameters
