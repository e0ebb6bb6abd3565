"""LoRAPoolBatch: one pass's LoRA on the Triton path (engine/kernels/lora_gemm.py).

`token_slots` [T] int32 is each token's pool slot (-1: the base model). The tokens' grouping by
slot is computed once per pass, at the first target linear, from the device tensor alone: inside
a CUDA graph the slots are a static buffer the replay refills, and the grouping is replayed too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class LoRAPoolBatch:
    def __init__(self, pool: Any, token_slots: torch.Tensor, deterministic: bool) -> None:
        self.pool = pool  # engine.lora.lora_pool.LoRAPool (which imports this module)
        self.token_slots = token_slots
        self.deterministic = deterministic
        self._align: Optional[Any] = None
        self._block_m = 0

    def begin_pass(self) -> None:
        """Group the tokens again at the next linear (a CUDA graph's warm-up and capture reuse this batch)."""
        self._align = None

    def apply(self, module_name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base linear's output for x) with each adapter token's delta added in place."""
        from engine.kernels.lora_gemm import align_slots, lora_block_m, lora_expand, lora_shrink

        buf = self.pool.modules.get(module_name)
        if buf is None:
            return out
        if self._align is None:
            self._block_m = lora_block_m(self.token_slots.numel(), self.deterministic)
            self._align = align_slots(self.token_slots, self.pool.num_slots, self._block_m)
        x = x if x.stride(-1) == 1 else x.contiguous()
        h = lora_shrink(x, buf.a, self._align, self._block_m, self.deterministic)
        R = self.pool.max_rank
        for p, rows in enumerate(buf.shard_rows):
            lora_expand(h[:, p * R:(p + 1) * R], buf.b[:, rows], out[:, rows], self.pool.scaling, self._align,
                        self._block_m)
        return out
