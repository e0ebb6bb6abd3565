"""LoRABatch: which adapter each token of one forward pass uses, as the target linears read it.

`token_slots` [T] is the per-token adapter index (-1: the base model) into `adapters`, the
distinct adapters of the batch (at most --max-loras-per-batch). This is the torch path
(--lora-backend torch_native: the CPU's, and the oracle of the Triton path, pool_batch.py). It
groups the tokens of each adapter (`rows`, ascending) and adds each adapter's delta to its rows
only: a base token's output is never touched, and with batch-invariant matmuls a token's delta
does not depend on which other tokens or adapters share the pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.kernels.device_copy import h2d
from engine.lora.adapter import LoRAAdapter


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int64 on the device; -1 = base
    adapters: list[LoRAAdapter]
    rows: list[torch.Tensor]  # per adapter: its token rows, int64 on the device
    deterministic: bool = False

    @classmethod
    def build(cls, lora_ids: list[Optional[int]], tokens_per_req: list[int], by_id: dict[int, LoRAAdapter],
              device: torch.device, deterministic: bool) -> Optional["LoRABatch"]:
        """None when no request of the batch uses an adapter (the base model's own pass)."""
        used = sorted({i for i in lora_ids if i is not None})
        if not used:
            return None
        slots = token_slots(lora_ids, {lora_id: slot for slot, lora_id in enumerate(used)}, tokens_per_req, torch.int64)
        rows = [h2d(torch.nonzero(slots == s).flatten(), device) for s in range(len(used))]
        return cls(h2d(slots, device), [by_id[i] for i in used], rows, deterministic)

    def apply(self, module_name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base linear's output for x) plus each token's adapter delta, adapters in slot order."""
        if out.requires_grad:  # a trainer's pass: the base output may come from a custom autograd
            out = out.clone()  # Function (the GPU's batch-invariant matmul), whose views can't be written
        for adapter, rows in zip(self.adapters, self.rows):
            module = adapter.modules.get(module_name)
            if module is not None:
                out = module.delta_into(x, out, rows, self.deterministic)
        return out


def token_slots(lora_ids: list[Optional[int]], slot_of: dict[int, int], tokens_per_req: list[int],
                dtype: torch.dtype) -> torch.Tensor:
    """[T] on the host: each token's slot (slot_of[its request's adapter]; -1 for the base model)."""
    return torch.repeat_interleave(torch.tensor([-1 if i is None else slot_of[i] for i in lora_ids], dtype=dtype),
                                   torch.tensor(tokens_per_req, dtype=torch.int64))
