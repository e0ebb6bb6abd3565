"""bi_gemv: deterministic mode's linears at a decode batch of 1..ROWS rows on the small-M gemv, with
the batch-invariant matmul's bits (on by default; TANDEM_DET_GEMV=0 keeps the matmul).

At batch 1 deterministic mode keeps its batch-invariant matmul (engine/kernels/batch_invariant/
triton_matmul.py), whose 16-row MMA tiles take 0.9-1.1x cuBLAS's time, where normal mode's
small-M gemv (engine/kernels/small_m_linear.py) streams the weight over every SM: most of
deterministic mode's batch-1 cost (9.5% on the 8B shape, H100). The two compute an output the same
way: a fresh fp32 accumulation of k16 tensor-core steps, in ascending k, over each K split, and the
splits summed in order from 0 (0 + p0 + p1 ...; the gemv's split-sum kernel, or its direct store for
one split), bias added before the one rounding. On sm_90 the matmul's docstring records that neither
the tile's rows (16 or 64), columns nor k step change a bit of that chain. So the gemv run with the
matmul's own split boundaries (its table's split_k: `config`) gives the matmul's bits at every
M: tests/gpu/test_batch_invariant_gpu.py checks it against bi_linear (passed on an H100, as did
policy parity, HF greedy and 20 determinism trials of the 8B shape under it; 8B deterministic
batch 1: 159.6 vs 152.5 tok/s without, normal mode 167.6). Shapes whose K the split does not
divide evenly keep the matmul. o_proj and down_proj also take normal mode's add + norm epilogue (`bi_gemv_add_norm`): the split-K sum kernel's norm
has the batch-invariant norm's launch shape and its operations in its order (x + residual rounded,
then the sum of squares over the same block, rsqrt, the two roundings), so its bits too (that rests
on both kernels compiling the sum of squares alike; the GPU test checks it).

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.kernels import env_choice
from engine.kernels.batch_invariant import triton_ops
from engine.kernels.small_m_linear import GemvConfig, rows_switch, small_m_linear, small_m_linear_add_norm
from engine.kernels.small_m_linear import applies as gemv_applies, applies_add_norm as gemv_applies_add_norm

ENABLED = env_choice("TANDEM_DET_GEMV", "1", ("0", "1"), "1 (on, the default) or 0 (off: the batch-invariant matmul)") == "1"
# the most rows taken (more: the matmul); past 16 rows the gemv pads x to a 32-row tile. 32 by
# default: H100, 8B bs 32, 3,332.7 tok/s vs 3,261.7 at 8 rows (normal mode 3,459.9: the cost 3.7%
# instead of 5.7%); the bitwise tests to 32 rows and 10 determinism trials in five modes passed.
ROWS = rows_switch("TANDEM_DET_GEMV_MAX_M", "32")
BLOCK_K = 128  # the gemv's k step; a split must be a whole number of them


def config(N: int, K: int, dtype: torch.dtype) -> Optional[GemvConfig]:
    """The gemv tile whose K splits are the batch-invariant matmul's for (N, K, dtype); None where
    they cannot be (a split not a whole number of k steps, or K not a whole number of splits)."""
    cfg = triton_ops.matmul_config(N, K, dtype)
    splits = cfg.num_splits(K)
    if splits > 1 and (cfg.split_k % BLOCK_K or K % cfg.split_k):
        return None
    return GemvConfig(block_n=64, block_k=BLOCK_K, split_k=splits)


def applies(x: torch.Tensor, weight: torch.Tensor, wide: bool = False) -> bool:
    """On (TANDEM_DET_GEMV, the default), a bf16 call the small-M gemv takes (1..ROWS rows, no autograd; `wide`: qkv or gate_up,
    which it takes under TANDEM_PDL=wide only), on a device whose matmul tiles were measured bit for
    bit (sm_90, and in bf16 only; the CPU interpreter for tests), and a shape whose splits the gemv
    can take."""
    return (ENABLED and x.dtype == torch.bfloat16 and gemv_applies(x, weight, wide=wide, max_rows=ROWS)
            and triton_ops._tiers_measured_on(x.device) and config(weight.shape[0], weight.shape[1], x.dtype) is not None)


def applies_add_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`applies`, and where normal mode's epilogue would (small_m_linear.applies_add_norm: an output
    row one norm program holds, TANDEM_SMALL_M_EPILOGUE not 0)."""
    return applies(x, weight) and gemv_applies_add_norm(x, weight, max_rows=ROWS)


def bi_gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bi_rms_norm(bi_linear(x, weight, bias), norm_weight, eps, residual) for a few rows: the gemv's
    split-K sum adds the residual and norms in the batch-invariant norm's launch shape, with its
    operations in its order (engine/kernels/batch_invariant/triton_norm.py); one split: the gemv
    writes y and that norm runs as its own launch."""
    return small_m_linear_add_norm(x, weight, bias, residual, norm_weight, eps,
                                   config=_config_or_raise(weight, x.dtype))


def bi_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bi_linear(x, weight, bias) for a few rows, on the small-M gemv (see the module docstring)."""
    return small_m_linear(x, weight, bias, config=_config_or_raise(weight, x.dtype))


def _config_or_raise(weight: torch.Tensor, dtype: torch.dtype) -> GemvConfig:
    cfg = config(weight.shape[0], weight.shape[1], dtype)
    if cfg is None:
        raise ValueError(f"bi_gemv: no gemv split matches the matmul's for weight {tuple(weight.shape)}")
    return cfg
