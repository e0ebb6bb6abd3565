"""LoRA's grouped GEMMs: a LoRA forward is top-1 MoE routing with weight 1, so it reuses the MoE
kernels. Tokens are grouped by adapter slot with moe_align (block-aligned segments; base tokens,
slot -1, are in no segment and never read or written), then per target linear:

  shrink   h[t] = x[t] @ A[slot]^T                       [T, shards * R] (R: the pool's max rank)
  expand   out[t, rows_p] += scale[slot] * h[t, p*R:(p+1)*R] @ B[slot, rows_p]^T   per shard p

Ranks below R are zero-padded in the pool, which adds exact zeros. In deterministic mode one
tile config serves every batch (block_m fixed, reduction over the whole K in ascending BLOCK_K
steps, no split-K, no atomics): a token's bits do not depend on what else shares its batch (see
moe_gemm's docstring). Normal mode picks block_m by the token count.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton

from engine.kernels.moe_align import MoeAlignment, moe_align
from engine.kernels.moe_gemm import MoeTileConfig, expert_gemm

DETERMINISTIC_BLOCK_M = 32


def lora_block_m(num_tokens: int, deterministic: bool) -> int:
    if deterministic:
        return DETERMINISTIC_BLOCK_M
    return 16 if num_tokens <= 512 else 64  # decode: few rows per adapter; prefill: reuse each tile


def align_slots(token_slots: torch.Tensor, num_slots: int, block_m: int) -> MoeAlignment:
    """token_slots [T] int32 (-1: base) -> the tokens of each slot in block_m-padded segments."""
    return moe_align(token_slots.view(-1, 1), num_slots, block_m)


def _shrink_config(block_m: int, n: int, deterministic: bool) -> MoeTileConfig:
    # n (shards * R) is narrow and K long: decode's few row blocks would leave most SMs idle with
    # one n tile each, so normal mode splits n finer (x is re-read from L2); deterministic mode
    # keeps one tile shape for every batch
    block_n = 16 if block_m == 16 and not deterministic else min(64, max(16, triton.next_power_of_2(n)))
    return MoeTileConfig(block_m=block_m, block_n=block_n, block_k=64, group_m=1, num_warps=4, num_stages=3)


def _expand_config(block_m: int, rank: int) -> MoeTileConfig:
    return MoeTileConfig(block_m=block_m, block_n=64, block_k=max(16, triton.next_power_of_2(rank)),
                         group_m=1, num_warps=4, num_stages=2)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, align: MoeAlignment, block_m: int,
                deterministic: bool) -> torch.Tensor:
    """x [T, in], lora_a [S, shards * R, in] -> h [T, shards * R] (rows of base tokens unset)."""
    h = torch.empty(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    expert_gemm(x, lora_a, h, align, x.shape[0], 1, False, _shrink_config(block_m, lora_a.shape[1], deterministic))
    return h


def lora_expand(h: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, scaling: torch.Tensor,
                align: MoeAlignment, block_m: int) -> None:
    """out [T, n] += scaling[slot] * h [T, R] @ lora_b[slot] [n, R]^T, in place, routed rows only
    (views are fine: unit stride along the last dim)."""
    expert_gemm(h, lora_b, out, align, h.shape[0], 1, False, _expand_config(block_m, h.shape[1]),
                add_scaled=scaling)
