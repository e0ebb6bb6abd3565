"""LoRAPoolBatch: one pass's LoRA over the device pool (engine/lora/lora_pool.py).

`token_slots` [T] int32 is each token's pool slot (-1: the base model). Two ways to add the deltas:

- dense (normal mode, the pool's default): every slot's shrink in one GEMM, x @ A_all^T
  [T, S * shards * R]; each token keeps only its own slot's columns, times its adapter's scaling
  (a [T, S] mask built once per pass); then per shard one GEMM accumulating into the output,
  out[:, rows] += h_masked @ b_rows[rows]^T (K = S * R, other slots' columns exact zeros). Library
  GEMMs at every batch size; the price is computing all S slots, which at decode is cheaper than
  grouping: the grouped shrink's few programs over a long K left most SMs idle.
- grouped (deterministic mode, or a pool built with dense=False; engine/kernels/lora_gemm.py):
  tokens grouped by slot with moe_align, one tile shape for every batch, so a token's bits do not
  depend on what else shares its batch.

Per-pass state (the mask, the grouping) is computed at the first target linear from the device
tensor alone: inside a CUDA graph the slots are a static buffer the replay refills, and that work
is replayed too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class LoRAPoolBatch:
    def __init__(self, pool: Any, token_slots: torch.Tensor, deterministic: bool) -> None:
        self.pool = pool  # engine.lora.lora_pool.LoRAPool (which imports this module)
        self.token_slots = token_slots
        self.deterministic = deterministic
        self.dense = pool.dense and not deterministic
        self._mask: Optional[torch.Tensor] = None
        self._align: Optional[Any] = None
        self._block_m = 0

    def begin_pass(self) -> None:
        """Recompute the per-pass state at the next linear (a CUDA graph's warm-up and capture reuse this batch)."""
        self._mask = self._align = None

    def apply(self, module_name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base linear's output for x) with each adapter token's delta added in place."""
        buf = self.pool.modules.get(module_name)
        if buf is None:
            return out
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.dense:
            self._dense(buf, x, out)
        else:
            self._grouped(buf, x, out)
        return out

    def _dense(self, buf: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        S, R, shards, T = self.pool.num_slots, self.pool.max_rank, len(buf.shard_rows), x.shape[0]
        if self._mask is None:
            slots = torch.arange(S, device=x.device, dtype=self.token_slots.dtype)
            scale = self.pool.scaling.to(x.dtype)
            self._mask = torch.where(self.token_slots.view(-1, 1) == slots, scale, torch.zeros_like(scale))
        h = torch.mm(x, buf.a.view(-1, buf.a.shape[-1]).t())  # [T, S * shards * R]: (slot, shard, r)
        kept = torch.empty(T, shards, S, R, dtype=x.dtype, device=x.device)  # (shard, slot, r): K per shard
        torch.mul(h.view(T, S, shards, R).transpose(1, 2), self._mask.view(T, 1, S, 1), out=kept)
        for p, rows in enumerate(buf.shard_rows):
            out[:, rows].addmm_(kept[:, p].reshape(T, S * R), buf.b_rows[rows].t())

    def _grouped(self, buf: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        from engine.kernels.lora_gemm import align_slots, lora_block_m, lora_expand, lora_shrink

        if self._align is None:
            self._block_m = lora_block_m(self.token_slots.numel(), self.deterministic)
            self._align = align_slots(self.token_slots, self.pool.num_slots, self._block_m)
        h = lora_shrink(x, buf.a, self._align, self._block_m, self.deterministic)
        R = self.pool.max_rank
        for p, rows in enumerate(buf.shard_rows):
            lora_expand(h[:, p * R:(p + 1) * R], buf.b[:, rows], out[:, rows], self.pool.scaling, self._align,
                        self._block_m)
