"""What rank 0 sends the other tensor-parallel ranks, one broadcast each (TPGroup.broadcast_object).

Everything a worker needs to run the same forward pass as rank 0, in host form: the ForwardBatch's
tensors and host lists, the rows that need logits, and the req_to_token entries the step reads
(the scheduler's table lives on rank 0 only). A worker never decides anything: it runs what it is
sent, in the order sent, so the ranks' collectives always pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from engine.forward_batch import ForwardMode


@dataclass(frozen=True)
class KVPlan:
    """Sent once at start-up: the worker's pools take rank 0's sizes (KV slots are rank 0's ids)."""
    max_total_num_tokens: int
    req_rows: int
    context_len: int


@dataclass
class ForwardStep:
    forward_mode: ForwardMode
    input_ids: Optional[torch.Tensor]  # None: sent by a device broadcast (a lookahead step)
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    logit_rows: torch.Tensor  # rows of the hidden states projected to logits (the LM head is collective)
    # [3, n] (row, column, slot) entries of req_to_token to write before the step (a prefill's
    # whole rows, rows rewritten since the last step); None: none. A decode step's one new entry
    # per request follows from (req_pool_indices, positions, out_cache_loc).
    table_entries: Optional[torch.Tensor]

    @classmethod
    def of(cls, batch: Any, fb: Any, logit_rows: torch.Tensor,
           table_entries: Optional[torch.Tensor]) -> "ForwardStep":
        """From rank 0's ScheduleBatch and ForwardBatch, in host form without reading the device
        back (that would stall overlap scheduling): a tensor already on the CPU is sent as is,
        others are rebuilt from the batch. Input ids that only the device holds (a lookahead step
        feeding the previous step's samples) are None here: they follow by a device broadcast."""
        on_host = fb.input_ids.device.type == "cpu"
        host = lambda t, rebuild: t if t.device.type == "cpu" else rebuild()  # noqa: E731
        longs = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        input_ids = None if batch.lookahead and not on_host else host(fb.input_ids, lambda: longs(batch.input_ids()))
        rows = host(fb.req_pool_indices, lambda: longs([r.req_pool_idx for r in batch.reqs]))
        return cls(fb.forward_mode, input_ids, host(fb.positions, lambda: longs(batch.positions())),
                   batch.out_cache_loc, rows, longs(fb.seq_lens_cpu), list(fb.seq_lens_cpu),
                   list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu), logit_rows.cpu(),
                   table_entries)


@dataclass(frozen=True)
class LoadWeights:
    """A weight update: every rank loads its own shards of the same full tensors, read from a
    source (a checkpoint every rank can read) or sent along (what rank 0 received)."""
    source: Any = None
    named_tensors: Optional[list] = None


@dataclass(frozen=True)
class DiscardWeights:
    """A refused broadcast update: every rank receives the trainer's tensors and drops them."""
    source: Any


@dataclass(frozen=True)
class Stop:
    pass
