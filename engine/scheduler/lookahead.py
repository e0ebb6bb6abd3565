"""lookahead_rows: may the next decode step be launched before the last one's tokens are read?

With overlap scheduling, decode step N+1 is launched while step N still runs: every request
feeds its in-flight token (still on the device) at position seq_len, so the host needs none of
those values to build the step's forward. Sampling that reads the output so far (a grammar's
mask, penalties, min_new_tokens) is launched after step N is committed (sample_after_commit).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.request import Req


class SchedulerView(Protocol):
    """What lookahead reads of the Scheduler (which imports this module, so no import back)."""
    waiting: Sequence[Req]
    running: list[Req]
    chunked_req: Optional[Req]
    allocator: Any  # engine.kv.allocator.TokenSlotAllocator: available_size()


def lookahead_rows(scheduler: SchedulerView, inflight: ScheduleBatch) -> Optional[list[int]]:
    """Rows of `inflight` to continue, or None when the step must wait for its tokens: new work
    to admit, aborts, memory pressure (evict or retract only once the real tokens are in), or
    sampling state that reads the unknown token."""
    if scheduler.waiting or scheduler.chunked_req is not None or not inflight.forward_mode.is_decode:
        return None
    if any(r.to_abort is not None for r in scheduler.running):
        return None
    rows = [i for i, r in enumerate(inflight.reqs) if not r.finished]  # finished ones drop out
    if not rows or len(rows) != len(scheduler.running) or scheduler.allocator.available_size() < len(rows):
        return None
    return rows


def sampling_reads_last_token(req: Req) -> bool:
    """Penalties, min_new_tokens and a grammar (its vocab mask) read the output so far: such a
    step's forward may still run ahead, but its sampling waits for the real token (the core
    commits the previous step between the two)."""
    p = req.sampling_params
    return (req.grammar is not None or p.min_new_tokens > len(req.output_ids) + 1
            or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
