"""A grammar's packed token bitmask applied to logits (xgrammar's layout: [B, ceil(V/32)] int32,
bit set = allowed).

On CUDA one Triton pass (engine/kernels/token_bitmask.py); elsewhere, and where Triton does not
import, the torch path: unpack to a [B, V] bool, then masked_fill. Both give the same values.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from engine.kernels import optional_kernel


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new [B, V] tensor: logits where the row's bitmask allows the token, -inf elsewhere."""
    kernel = _kernel() if logits.is_cuda else None
    if kernel is not None:
        return kernel.masked_logits(logits, bitmask)
    return masked_logits_torch(logits, bitmask)


def masked_logits_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(unpack_forbidden(bitmask, logits.shape[-1]), float("-inf"))


def unpack_forbidden(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit set = allowed) -> [B, V] bool (True = forbidden), on bitmask's device."""
    return ((bitmask.unsqueeze(-1) & _bit_values(bitmask.device)) == 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]


@functools.lru_cache(maxsize=None)
def _bit_values(device: torch.device) -> torch.Tensor:
    """[32] int32: 1 << k for each bit k (bit 31 is int32's sign bit); made once per device."""
    return torch.tensor([(1 << k) - (1 << 32 if k == 31 else 0) for k in range(32)], dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _kernel() -> Optional[ModuleType]:
    return optional_kernel("token_bitmask")
