"""The forward contract: ForwardMode (decided by the scheduler) and ForwardBatch (the device-side
description of one forward pass, passed explicitly to the models and attention backends).

This module sits below the scheduler, attention, models and runner, and imports none of them.
Every forward is an "extend": each sequence i appends extend_seq_lens_cpu[i] new tokens after
extend_prefix_lens_cpu[i] tokens whose KV is already in the pool. A decode step is the case where
every sequence extends by one token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly chunked, possibly over a cached prefix)
    DECODE = "decode"  # one new token per sequence

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences back to back
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV pool slot each new token writes to
    req_pool_indices: torch.Tensor  # [B] int64, row of req_to_token for each sequence
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens
    # host copies, so backends can loop without syncing the device
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # tokens already in the pool
    extend_seq_lens_cpu: list[int]  # new tokens this pass
    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int64 slot table
    kv_pool: Any  # engine.kv.pool.KVPool (named loosely: this contract sits below kv and attention)
    attn_backend: Any  # engine.attention.base.AttentionBackend
    # engine.lora.LoRABatch (torch path) or LoRAPoolBatch (Triton path): each token's adapter and the
    # adapters' weights; None when no request of the pass uses one
    lora: Any = None
    # engine.attention.shared_prefix.SharedPrefixPlan: decode rows whose cached prefix is the same
    # KV (backends with wants_shared_prefix read it once per layer); None: nothing shared
    shared_prefix: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
