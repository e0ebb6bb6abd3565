"""A grammar's packed token bitmask applied to logits (xgrammar's layout: [B, ceil(V/32)] int32,
bit set = allowed).

On CUDA one Triton pass (engine/kernels/token_bitmask.py); elsewhere, and where Triton does not
import, the torch path: unpack to a [B, V] bool, then masked_fill. Both give the same values.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Optional

import torch

from engine.kernels import optional_kernel

logger = logging.getLogger(__name__)
_FAILED: list[str] = []  # the kernel's first failure (it compiles at its first call): the torch path from then on


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A new [B, V] tensor: logits where the row's bitmask allows the token, -inf elsewhere. A
    kernel that fails (its compile, on a machine whose Triton cannot build it) is dropped with a
    warning and the torch path serves this call and every later one."""
    kernel = _kernel_for(logits)
    if kernel is not None:
        try:
            return kernel.masked_logits(logits, bitmask)
        except Exception as exc:
            _FAILED.append(f"{type(exc).__name__}: {exc}")
            logger.warning("the grammar mask's Triton pass failed (%s); masking with torch ops instead", _FAILED[0])
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


def _kernel_for(logits: torch.Tensor) -> Optional[ModuleType]:
    return _kernel() if _on_gpu(logits) and not _FAILED else None


def _on_gpu(logits: torch.Tensor) -> bool:
    return logits.is_cuda


@functools.lru_cache(maxsize=None)
def _kernel() -> Optional[ModuleType]:
    return optional_kernel("token_bitmask")
