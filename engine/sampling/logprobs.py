"""Logprobs under the ORIGINAL distribution: log_softmax of the raw fp32 logits.

This is the number RL trainers recompute, so it is taken before temperature, penalties,
top-k/top-p/min-p and any masks. Everything that reports original logprobs goes through
`original_logprobs`, so a batch-invariant log_softmax only has to be swapped in here (the
`log_softmax` argument, given in deterministic mode).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Callable, Optional

import torch

from engine.kernels import batch_invariant, optional_kernel

LogSoftmax = Callable[[torch.Tensor], torch.Tensor]  # [N, V] -> [N, V] float32, over the last dim


def original_logprobs(logits: torch.Tensor, log_softmax: Optional[LogSoftmax] = None) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] float32 log_softmax."""
    if log_softmax is not None:
        return log_softmax(logits.float())
    return torch.log_softmax(logits.float(), dim=-1)


def greedy_with_logprobs(logits: torch.Tensor, log_softmax: Optional[LogSoftmax] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, V] logits -> (argmax ids [N] int64, their original logprobs [N] float32). On CUDA in
    normal mode one fused read of the logits (engine/kernels/greedy_logprob.py); in deterministic
    mode the batch-invariant log_softmax's own reduction, its value at the argmax only (the same
    bits, [N, V] not written); elsewhere argmax + log_softmax + gather."""
    if log_softmax is None and logits.is_cuda and logits.dim() == 2:
        kernel = _greedy_kernel()
        if kernel is not None:
            return kernel.greedy_logprob(logits)
    if log_softmax is batch_invariant.log_softmax and not _greedy_kernel_disabled():
        return batch_invariant.greedy_log_softmax(logits.float())
    ids = torch.argmax(logits, dim=-1)
    return ids, gather_token_logprobs(original_logprobs(logits, log_softmax), ids)


def _greedy_kernel_disabled() -> bool:
    return bool(os.environ.get("TANDEM_DISABLE_FUSED_GREEDY"))  # A/B benchmarks


@functools.lru_cache(maxsize=None)
def _greedy_kernel() -> Optional[ModuleType]:
    return None if _greedy_kernel_disabled() else optional_kernel("greedy_logprob")


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logprobs [N, V], token_ids [N] -> [N]: the logprob of each row's token (prompt logprobs)."""
    return logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int, log_softmax: Optional[LogSoftmax] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k tokens per row under the original distribution: (values [N,k], ids [N,k])."""
    return top_k_of(original_logprobs(logits, log_softmax), k)


def top_k_of(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of logprobs [N, V], sorted: (values [N,k], ids [N,k])."""
    k = min(k, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return values, ids
