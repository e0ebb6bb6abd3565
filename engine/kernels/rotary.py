"""apply_rotary: the reference rotary embedding (torch), shared by the models and the fused kernel.

The model's unfused path (engine/models/decoder.py) and qk_norm_rope's reference and backward
(engine/kernels/qk_norm_rope.py) must be the same arithmetic, so it lives here, in the leaf.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] float32, cast to x's dtype first (as HF)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
