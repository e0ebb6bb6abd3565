"""Public batch-invariant ops on CUDA (Triton): bi_linear, bi_rms_norm, bi_log_softmax.

The matmul configuration is data: a table keyed by (N, K, dtype) plus a default rule for other
shapes that also looks only at (N, K, dtype). Its arithmetic fields (split_k, dot precision) are
never chosen by M: changing them changes the bits, so the trainer and the engine must use the
same table. M may choose only the tile (`M_TIERS`: from some M on, another tile shape, warps or
stages), because on sm_90 the tile does not change a bit: every output element is the
same chain of k16 tensor-core steps, with the same split boundaries, whichever tile holds it.
Measured, not assumed: scripts/bi_matmul_bench.py compares every candidate tile's output with
the table tile's, bit for bit, on all five Qwen3-8B shapes at M from 1 to 4096 (block_m
16/32/64/128/256, block_n 32..256, block_k 64/128, 4 or 8 warps, 2-8 stages, flat or nested
loops: all identical), and tests/gpu/test_batch_invariant_gpu.py checks rows across every tier
switch. Those measurements were in bf16, so the tiers serve bf16 only; fp16 keeps the table tile.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from engine.kernels.batch_invariant import triton_matmul, triton_norm
from engine.kernels.batch_invariant.triton_matmul import MatmulConfig

_HALF = ("bf16", "fp16")

# Qwen3-8B (hidden 4096, q 32x128 + kv 2x8x128, intermediate 12288, vocab 151936), bf16/fp16.
# (N, K): config. Small-M parallelism comes from split_k: N/block_n tiles x K/split_k splits; at
# M ~ 64 every split costs an fp32 partial of M x N written and read, so qkv and down use 2048
# (qkv M=64: 1.41 -> 1.15-1.18x cuBLAS, down 1.45 -> 1.20-1.24x; H200, scripts/bi_matmul_bench.py).
_HALF_TABLE: dict[tuple[int, int], MatmulConfig] = {
    (6144, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=2048, num_warps=4, num_stages=4),
    (4096, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=1024, num_warps=4, num_stages=4),
    (24576, 4096): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=2048, num_warps=4, num_stages=4),
    (4096, 12288): MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=2048, num_warps=4, num_stages=4),
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


@functools.lru_cache(maxsize=None)
def default_config(N: int, K: int, dtype_key: str) -> MatmulConfig:
    """Rule for shapes outside the table; a function of (N, K, dtype) only."""
    if dtype_key == "fp32":
        # "ieee": the same products and fp32 sums F.linear does without TF32 (CUDA cores, slower)
        return MatmulConfig(block_m=32, block_n=64, block_k=32, split_k=1024 if K >= 4096 else 0,
                            num_warps=4, dot_precision="ieee", num_stages=3, use_tma=False)
    # Split K only when the weight alone gives few column tiles (few programs at small M).
    split = 1024 if (N // 128) < 128 and K >= 2048 else 0
    return MatmulConfig(block_m=64, block_n=128, block_k=64, split_k=split, num_warps=4, num_stages=4)


# (N, K): tiers (first M that uses it, tile), ascending; below the first tier the table entry's
# own tile, and {} is that tile again. Picked per M from scripts/bi_matmul_bench.py --configs on
# the H200 (graph-timed, cold L2, docs/benchmarks.md); every tile here gave the table tile's bits
# at every M. Small M: 16-row tiles (below wgmma's 64 rows; same bits, measured) take 0.9-1.11x
# cuBLAS's time at M = 1-8 where the 64-row wgmma tile took 1.2-1.4x. M 65-1023: picked on a
# grid of 16 Ms (64..1024, a point per 64-row step), fourth session: a tile is fast only on
# some steps of M (tile count vs 132 SMs), so the best one changes every 64-128 rows.
# block_k explicit: a table entry's block_k=128 with this tile would need 288 KB of shared memory
_WIDE = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, flat=False)  # 1.07-1.14x
_M16 = dict(block_m=16)
_M16N64 = dict(block_m=16, block_n=64, num_stages=6)
_K128 = dict(block_k=128)
_NEST = dict(block_m=128, num_warps=8, num_stages=5, flat=False)  # gate_up M=256: 1.30 -> 1.17x
_N256 = dict(block_n=256, num_warps=8, num_stages=4, flat=False)
# "seq" even where the tile count alone would pick "par" (same bits; schedule only): with 64-128
# output tiles the split partials' round trip cost more than the SMs it filled (measured: down
# M=96 52.6 -> 44.0 us, qkv 26.5 -> 19.8 us)
_SEQ = dict(par_max_tiles=1)
_K128_SEQ = {**_K128, **_SEQ}
_HALF_TIERS: dict[tuple[int, int], tuple[tuple[int, dict], ...]] = {
    (6144, 4096): ((1, _M16N64), (32, _K128), (65, _K128_SEQ), (193, {}), (321, _K128), (513, _NEST),
                   (1024, _WIDE)),
    (4096, 4096): ((1, _M16N64), (32, _K128), (65, _K128_SEQ), (385, _NEST), (513, _K128),
                   (1024, _WIDE)),
    (24576, 4096): ((1, _M16), (32, dict(block_m=32)), (96, _NEST), (129, _K128), (193, _NEST),
                    (257, _N256), (321, _NEST), (1024, _WIDE)),
    (4096, 12288): ((1, _M16), (32, {}), (65, _K128_SEQ), (385, _NEST), (513, _K128), (1024, _WIDE)),
    (151936, 4096): ((128, dict(block_m=128, block_n=256, num_warps=8, num_stages=4)),),
}

M_TIERS: dict[tuple[int, int, str], tuple[tuple[int, dict], ...]] = {
    (n, k, "bf16"): tiers for (n, k), tiers in _HALF_TIERS.items()  # measured in bf16 only
}
# what a tier may change: the tile, and the schedule's threshold (par_max_tiles: same bits)
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "flat", "group_m", "par_max_tiles")


def matmul_config(N: int, K: int, dtype: torch.dtype, M: int | None = None,
                  device: torch.device | None = None) -> MatmulConfig:
    """The (N, K, dtype) config; with M, its tile for that M (same arithmetic, see module doc).
    The tiers were measured (bits and shared memory) on sm_90 only: other GPUs get the table tile."""
    key = _dtype_key(dtype)
    cfg = CONFIG_TABLE.get((N, K, key)) or default_config(N, K, key)
    tile = None
    use_tiers = M is not None and (device is None or _tiers_measured_on(device))
    for from_m, tier in M_TIERS.get((N, K, key), ()) if use_tiers else ():
        if M >= from_m:
            tile = tier
    return _tiled(cfg, tuple(sorted(tile.items()))) if tile else cfg


@functools.lru_cache(maxsize=None)
def _tiled(cfg: MatmulConfig, tile: tuple) -> MatmulConfig:
    # per call on the eager (prefill) path: build each (config, tile) once
    return with_tile(cfg, **dict(tile))


def _tiers_measured_on(device: torch.device) -> bool:
    """sm_90 (H100/H200), or the CPU interpreter (tests)."""
    return device.type != "cuda" or _capability(device.index or 0) == (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def with_tile(cfg: MatmulConfig, **tile) -> MatmulConfig:
    """cfg with another tile; refuses fields that would change the arithmetic."""
    bad = sorted(set(tile) - set(TILE_FIELDS))
    if bad:
        raise ValueError(f"with_tile: {bad} are not tile fields (allowed: {', '.join(TILE_FIELDS)})")
    out = dataclasses.replace(cfg, **tile)
    if out.split_k > 0 and out.split_k % out.block_k:
        raise ValueError(f"with_tile: split_k {out.split_k} is not a multiple of block_k {out.block_k}")
    return out


def set_m_tiers(N: int, K: int, dtype: torch.dtype, tiers: tuple[tuple[int, dict], ...]) -> None:
    """Replace the M tiers of (N, K, dtype) (benchmarks, tests); () = the table tile at every M."""
    for _, tile in tiers:
        with_tile(matmul_config(N, K, dtype), **tile)  # validate now, not at the first large call
    M_TIERS[(N, K, _dtype_key(dtype))] = tuple(sorted(tiers, key=lambda t: t[0]))


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
    cfg = config or matmul_config(N, K, x.dtype, x2.shape[0], x.device)
    out = triton_matmul.matmul(x2, w, bias, cfg, schedule)
    return out.view(*x.shape[:-1], N)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm; with residual returns (norm(x + residual) * weight, x + residual), like vLLM."""
    return triton_norm.rms_norm(x, weight, eps, residual)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log_softmax over the last dim, one fixed reduction order per row."""
    return triton_norm.log_softmax(x)


def bi_greedy_log_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, its log_softmax value) of float32 rows: bi_log_softmax's bits, [N, V] not written."""
    return triton_norm.greedy_log_softmax(x)
