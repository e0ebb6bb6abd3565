"""Retraction: running requests back to the waiting queue when decode runs out of KV slots.

A retracted request keeps its output; its KV goes to the tree, evictable, so it is read back
from the cache when the request is admitted again if nothing needed the room meanwhile. The
count is the `num_retractions` metric; each retraction resets the admission forecast.
"""

from __future__ import annotations

import logging

import torch

from engine.finish_reasons import abort_reason
from engine.scheduler.new_token_ratio import NewTokenRatio
from engine.scheduler.queues import RequestQueues
from engine.scheduler.request import Req
from engine.scheduler.slots import KVSlots

logger = logging.getLogger(__name__)


class Retraction:
    def __init__(self, queues: RequestQueues, slots: KVSlots, forecast: NewTokenRatio) -> None:
        self.queues = queues
        self.slots = slots
        self.forecast = forecast
        self.count = 0

    def until_fits(self) -> None:
        """Retract the least advanced running requests until every other one gets a slot for its
        next token; a lone request that still does not fit ends with an error."""
        running = self.queues.running
        retracted = 0
        while self.slots.free_for_decode() < len(running) and len(running) > 1:
            # least progress first: fewest output tokens, then the longest prompt
            victim = min(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            running.remove(victim)
            self._retract(victim)
            retracted += 1
        if self.slots.free_for_decode() < len(running):
            self.queues.end(running[-1], abort_reason(
                "KV cache pool too small for this request; raise --max-total-tokens"))
        if retracted:
            self.count += retracted
            old = self.forecast.after_retraction(running)
            logger.warning("KV cache pool is full. Retract %d requests. new_token_ratio: %.4f -> %.4f",
                           retracted, old, self.forecast.value)

    def retract_all(self) -> None:
        """Every running request and the chunked one back to the front of the queue, in their
        order, keeping their outputs; their KV goes to the tree, evictable (pause, mode retract)."""
        q = self.queues
        active = q.active()
        q.running.clear()
        q.chunked_req = None
        for req in reversed(active):
            self._retract(req)

    def _retract(self, req: Req) -> None:
        self.slots.tree_cache.cache_finished_req(req)  # its KV stays in the tree, evictable
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node, req.kv_committed_len, req.is_chunked = None, 0, False
        req.num_retractions += 1
        self.queues.waiting.appendleft(req)
