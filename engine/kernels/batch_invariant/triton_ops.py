"""Public batch-invariant ops on CUDA (Triton): bi_linear, bi_rms_norm, bi_log_softmax.

The matmul configuration is data: a table keyed by (N, K, dtype) — never by M — plus a default
rule for other shapes that also looks only at (N, K, dtype). Changing an entry changes the bits
(tile shape, split length, warps, dot precision are part of the arithmetic), so the trainer and
the engine must use the same table. Scheduling fields (num_stages, group_m, use_tma,
par_max_tiles, reduce) never change bits.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.kernels.batch_invariant import triton_matmul, triton_norm
from engine.kernels.batch_invariant.triton_matmul import MatmulConfig

_HALF = ("bf16", "fp16")

# Qwen3-8B (hidden 4096, q 32x128 + kv 2x8x128, intermediate 12288, vocab 151936), bf16/fp16.
# (N, K): config. Small-M parallelism comes from split_k: N/block_n tiles x K/split_k splits.
_HALF_TABLE: dict[tuple[int, int], MatmulConfig] = {
    (6144, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=1024, num_warps=4, num_stages=4),
    (4096, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=1024, num_warps=4, num_stages=4),
    (24576, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=2048, num_warps=4, num_stages=4),
    (4096, 12288): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=1024, num_warps=4, num_stages=4),
    (151936, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=0, num_warps=4, num_stages=4),
}

CONFIG_TABLE: dict[tuple[int, int, str], MatmulConfig] = {
    (n, k, dt): cfg for (n, k), cfg in _HALF_TABLE.items() for dt in _HALF
}


def _dtype_key(dtype: torch.dtype) -> str:
    keys = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    if dtype not in keys:
        raise TypeError(f"bi_linear supports bf16/fp16/fp32, got {dtype}")
    return keys[dtype]


def default_config(N: int, K: int, dtype_key: str) -> MatmulConfig:
    """Rule for shapes outside the table; a function of (N, K, dtype) only."""
    if dtype_key == "fp32":
        # "ieee": the same products and fp32 sums F.linear does without TF32 (CUDA cores, slower)
        return MatmulConfig(block_m=32, block_n=64, block_k=32, split_k=1024 if K >= 4096 else 0,
                            num_warps=4, dot_precision="ieee", num_stages=3, use_tma=False)
    # Split K only when the weight alone gives few column tiles (few programs at small M).
    split = 1024 if (N // 128) < 128 and K >= 2048 else 0
    return MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=split, num_warps=4, num_stages=4)


def matmul_config(N: int, K: int, dtype: torch.dtype) -> MatmulConfig:
    key = _dtype_key(dtype)
    return CONFIG_TABLE.get((N, K, key)) or default_config(N, K, key)


def set_config(N: int, K: int, dtype: torch.dtype, cfg: MatmulConfig | None = None, **fields) -> None:
    """Override one table entry (benchmarks, tuning). Engine and trainer must agree on it."""
    base = cfg or matmul_config(N, K, dtype)
    CONFIG_TABLE[(N, K, _dtype_key(dtype))] = dataclasses.replace(base, **fields)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: MatmulConfig | None = None, schedule: str | None = None) -> torch.Tensor:
    """F.linear whose rows are bitwise independent of the batch: [..., K] x [N, K] -> [..., N]."""
    if x.dtype != weight.dtype:
        raise TypeError(f"bi_linear: x is {x.dtype} but weight is {weight.dtype}")
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"bi_linear: x has K={K} but weight is {tuple(weight.shape)}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 1 and x2.stride(0) != K:
        # a lone row may carry any row stride; give it the usual one so it gets the same kernel
        x2 = x2.as_strided((1, K), (K, 1))
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    cfg = config or matmul_config(N, K, x.dtype)
    out = triton_matmul.matmul(x2, w, bias, cfg, schedule)
    return out.view(*x.shape[:-1], N)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm; with residual returns (norm(x + residual) * weight, x + residual), like vLLM."""
    return triton_norm.rms_norm(x, weight, eps, residual)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the last dim, one fixed reduction order per row."""
    return triton_norm.log_softmax(x)
