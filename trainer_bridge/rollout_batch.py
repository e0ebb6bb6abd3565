"""RolloutBatch: the samples of one RL step, flattened for the trainer, with their advantages.

Keeps ragged per-sample lists (what Policy.rollout_logprobs takes) and pads to [B, T] only where
the loss needs it. `micro_batches` splits it for gradient accumulation; each micro batch knows its
share of the whole batch's tokens and sequences so the accumulated loss equals the full one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch


@dataclass(frozen=True)
class RolloutBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    loss_masks: list[list[int]]  # 1 where the policy produced the token (tool output is 0)
    rollout_logprobs: list[list[float]]
    advantages: list[float]  # one per sample
    token_share: float = 1.0  # this batch's masked tokens / its parent's (1 for a whole batch)
    seq_share: float = 1.0
    # MoE: each sample's routes as the engine returned them (base64), when every sample has them
    routed_experts: Optional[list[str]] = None

    @classmethod
    def from_samples(cls, samples: Sequence[Any], advantages: Sequence[float]) -> "RolloutBatch":
        """samples: rollout Samples (anything with prompt_ids, response_ids, loss_mask,
        rollout_logprobs, group and index; trainer_bridge does not import rollout/)."""
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        for s in samples:
            if not (len(s.response_ids) == len(s.rollout_logprobs) == len(s.loss_mask)):
                raise ValueError(f"sample {s.group}/{s.index}: {len(s.response_ids)} response tokens, "
                                 f"{len(s.rollout_logprobs)} logprobs, {len(s.loss_mask)} mask entries")
        kept = [i for i, s in enumerate(samples) if s.response_ids]  # an empty response has no token to train
        routes = [getattr(samples[i], "routed_experts", None) for i in kept]
        return cls([list(samples[i].prompt_ids) for i in kept], [list(samples[i].response_ids) for i in kept],
                   [list(samples[i].loss_mask) for i in kept], [list(samples[i].rollout_logprobs) for i in kept],
                   [float(advantages[i]) for i in kept],
                   routed_experts=routes if routes and all(r is not None for r in routes) else None)

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(m) for m in self.loss_masks)

    def padded(self, rows: Sequence[Sequence[float]], dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """Ragged rows (one per response) -> [B, T] padded with zeros."""
        width = max((len(r) for r in self.responses), default=0)
        out = torch.zeros(len(rows), width, dtype=dtype, device=device)
        for i, row in enumerate(rows):
            if len(row):
                out[i, :len(row)] = torch.as_tensor(row, dtype=dtype, device=device)
        return out

    def micro_batches(self, size: int) -> Iterator["RolloutBatch"]:
        if size <= 0:
            raise ValueError(f"micro batch size must be positive, got {size}")
        total_tokens = max(self.num_loss_tokens, 1)
        for start in range(0, len(self), size):
            sl = slice(start, start + size)
            masks = self.loss_masks[sl]
            yield RolloutBatch(self.prompts[sl], self.responses[sl], masks, self.rollout_logprobs[sl],
                               self.advantages[sl], token_share=sum(sum(m) for m in masks) / total_tokens,
                               seq_share=len(masks) / max(len(self), 1),
                               routed_experts=None if self.routed_experts is None else self.routed_experts[sl])
