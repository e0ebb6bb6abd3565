"""LigerOps: a normal-mode trainer's norms, activation and rope as Liger Kernel's Triton kernels.

Liger Kernel (linkedin/Liger-Kernel, what verl, TRL and OpenRLHF train with) has fused forward and
backward kernels for RMSNorm (with the residual add), SwiGLU over the fused gate|up output and
HF-style rope. The layers' torch code (TorchOps) takes ~6-12 launches per call and saves float32
intermediates; on the H200 the recipe's train step launched ~40k kernels, which left the GPU
waiting on the host (scripts/train_step_profile.py). Same math as TorchOps in HF's casting
("llama": the inverse RMS in float32, the product cast back before the weight), not the same
bits: normal mode needs none.

`autograd_ops(device)` picks LigerOps on CUDA when liger_kernel imports, else TorchOps.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from engine.models.layers import TorchOps

logger = logging.getLogger("tandem")


class LigerOps(TorchOps):
    def __init__(self) -> None:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

        self._norm, self._add_norm = LigerRMSNormFunction, LigerFusedAddRMSNormFunction
        self._rope, self._swiglu = LigerRopeFunction, LigerFusedGateUpSiLUMulFunction

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        rows = x.reshape(-1, x.shape[-1])
        if residual is None:  # in_place=False: the incoming gradient may be read by another consumer
            return self._norm.apply(rows, weight, eps, 0.0, "llama", False).view(x.shape)
        out, total = self._add_norm.apply(rows, residual.reshape(rows.shape), weight, eps, 0.0, "llama", False)
        return out.view(x.shape), total.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._swiglu.apply(x)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # Liger's layout is [batch, heads, seq, dim]: the packed tokens are one sequence whose
        # cos/sin rows are each token's own (cast to the activations' dtype first, as HF does)
        q4, k4 = self._rope.apply(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                                  cos.to(q.dtype), sin.to(q.dtype))
        return q4.transpose(1, 2)[0], k4.transpose(1, 2)[0]


def autograd_ops(device: torch.device) -> TorchOps:
    """LigerOps on CUDA when liger_kernel is installed (the `rl` extra), else the torch code."""
    if torch.device(device).type == "cuda":
        try:
            return LigerOps()
        except ImportError as exc:
            logger.warning("the trainer's norms, SwiGLU and rope run torch code (%s); pip install "
                           "'liger-kernel>=0.8.5' for its fused kernels (the recipe's train step at micro batch 32 on an H200: 0.74 s "
                           "and 35 GiB with them, 0.88 s and 41 GiB without)", exc)
    return TorchOps()
