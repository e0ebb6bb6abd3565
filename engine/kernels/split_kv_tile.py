"""The shape of a split-KV attention launch: KernelConfig (tile, warps, stages) and Tile.

Kernel-level types, so engine/kernels/split_kv_attention.py needs nothing from the attention
package; engine/attention/split_kv_plan.py chooses the configs and builds the plans around them.
No triton import: the CPU path plans with these too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # tile rows: q tokens x query heads of one kv group
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    fp_fusion: bool = True  # False: no mul+add contraction the compiler could place differently


@dataclass(frozen=True)
class Tile:
    """Kernel shape for one model: rows = block_t tokens x g_pad heads; block_t | block_n."""

    group: int
    g_pad: int
    block_t: int
    block_n: int
    config: KernelConfig

    @classmethod
    def build(cls, config: KernelConfig, group: int, split: int,
              kv_row_bytes: Optional[int] = None, smem_limit: Optional[int] = None) -> "Tile":
        """kv_row_bytes (head_dim x element size) and smem_limit (the device's per-block shared
        memory) shrink the config until its K/V stages fit (fit_shared_memory)."""
        if kv_row_bytes and smem_limit:
            config = fit_shared_memory(config, kv_row_bytes, smem_limit)
        g_pad = next_pow2(group)
        block_n = min(config.block_n, split)  # splits start on a key-block boundary
        block_t = max(1, min(config.block_m // g_pad, block_n))
        return cls(group, g_pad, block_t, block_n, config)


def fit_shared_memory(config: KernelConfig, kv_row_bytes: int, smem_limit: int) -> KernelConfig:
    """The default configs (split_kv_plan.DEFAULT_CONFIGS) were tuned for bf16, head_dim 128 on
    the H200 (~200 KB of K/V stages); fp32 K/V or a wider head would not compile. Drop to 2
    stages, then halve block_n, until stages x block_n rows of K and V plus the q and p tiles fit.
    A function of (config, dtype, head_dim, device) only, so engine and trainer on one GPU model
    pick the same tile (block_n is part of a deterministic row's arithmetic)."""
    def need(c: KernelConfig) -> int:
        return (c.num_stages * 2 * c.block_n + c.block_m) * kv_row_bytes + c.block_m * c.block_n * 4

    while need(config) > smem_limit and (config.num_stages > 2 or config.block_n > 16):
        if config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=2)
        else:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
    return config


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
