"""RequestQueues: where each request of the scheduler is, and how it leaves. Host-only.

A request waits, is prefilled (in chunks when long: `chunked_req`), runs, and leaves through
`release` when it finishes. Requests the scheduler ends on its own (aborted while running, too
large for the pool, out of memory) wait in `finished_here` until the core answers them.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from engine.finish_reasons import abort_reason
from engine.kv.base import PrefixCache
from engine.scheduler.request import Req


class RequestQueues:
    def __init__(self, tree_cache: PrefixCache) -> None:
        self.tree_cache = tree_cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.finished_here: list[Req] = []
        self.arrivals = 0  # requests queued so far; each one's `arrival` is its number

    def add_request(self, req: Req) -> None:
        req.arrival, self.arrivals = self.arrivals, self.arrivals + 1
        self.waiting.append(req)

    def num_in_flight_before(self, cutoff: int) -> int:
        """Requests queued before number `cutoff` that have not ended: running, half prefilled,
        or waiting (retracted ones included)."""
        return (sum(1 for r in self.active() if r.arrival < cutoff)
                + sum(1 for r in self.waiting if r.arrival < cutoff))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def active(self) -> list[Req]:
        """The requests whose KV is in the pool: running, or half prefilled."""
        return self.running + ([self.chunked_req] if self.chunked_req else [])

    def num_holding_kv(self) -> int:
        """Requests whose KV is in the pool: a flush must wait."""
        return len(self.active())

    def abort_request(self, rid: str, message: str = "aborted") -> Optional[Req]:
        """Waiting requests finish now; running ones are marked and released by the core."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = abort_reason(message)
                return req
        for req in self.active():
            if req.rid == rid:
                req.to_abort = message
                return req
        return None

    def finish_marked_aborts(self) -> None:
        for req in [r for r in self.active() if r.to_abort is not None]:
            self.end(req, abort_reason(req.to_abort))

    def pop_finished(self) -> list[Req]:
        """Requests the scheduler itself ended (aborted while running, or out of memory)."""
        done, self.finished_here = self.finished_here, []
        return done

    def end(self, req: Req, reason: dict) -> None:
        """End req here, for the core to answer (pop_finished)."""
        self.release(req)
        req.finished_reason = reason
        self.finished_here.append(req)

    def release(self, req: Req) -> None:
        """Give back everything a finished or aborted request holds."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
