"""Logprobs under the ORIGINAL distribution: log_softmax of the raw fp32 logits.

This is the number RL trainers recompute, so it is taken before temperature, penalties,
top-k/top-p/min-p and any masks. Everything that reports original logprobs goes through
`original_logprobs`, so a batch-invariant log_softmax only has to be swapped in here.
"""

from __future__ import annotations

import torch


def original_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] float32 log_softmax."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logprobs [N, V], token_ids [N] -> [N]: the logprob of each row's token (prompt logprobs)."""
    return logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k tokens per row under the original distribution: (values [N,k], ids [N,k])."""
    logprobs = original_logprobs(logits)
    k = min(k, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return values, ids
