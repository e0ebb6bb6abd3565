"""ForwardBatch: the device-side description of one forward pass, passed explicitly.

Every forward is an "extend": each sequence i appends extend_seq_lens_cpu[i] new tokens after
extend_prefix_lens_cpu[i] tokens whose KV is already in the pool. A decode step is the case where
every sequence extends by one token. ForwardMode (engine/scheduler/forward_mode.py) is the
scheduler's; it is re-exported here for the runner's callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.scheduler.forward_mode import ForwardMode

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.kv.pool import KVPool


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
    kv_pool: "KVPool"
    attn_backend: "AttentionBackend"

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
