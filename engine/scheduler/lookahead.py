"""lookahead_rows: may the next decode step be launched before the last one's tokens are read?

With overlap scheduling, decode step N+1 is launched while step N still runs: every request
feeds its in-flight token (still on the device) at position seq_len, so the host needs none of
those values to build the step. That is only safe when nothing about step N+1 depends on them.
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
    if any(not _sampling_ignores_last_token(r) for r in scheduler.running):
        return None
    rows = [i for i, r in enumerate(inflight.reqs) if not r.finished]  # finished ones drop out
    if not rows or len(rows) != len(scheduler.running) or scheduler.allocator.available_size() < len(rows):
        return None
    return rows


def _sampling_ignores_last_token(req: Req) -> bool:
    """Penalties, min_new_tokens and a grammar (its vocab mask) read the output so far, so they
    need the real token."""
    p = req.sampling_params
    return (req.to_abort is None and req.grammar is None and p.min_new_tokens <= len(req.output_ids) + 1
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)
