"""Scheduler: waiting queue, prefill admission, decode batches, retraction. Host-only.

Each step is either a prefill batch (requests admitted by Admission, the chunked request first)
or a decode batch of every running request. Prefill goes first, as in SGLang. The parts: the
queues (queues.py), admission (admission.py), retraction (retraction.py), and the KV slots they
hand out (slots.py); this class joins them and records what each forward pass produced.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.finish_reasons import abort_reason
from engine.forward_batch import ForwardMode
from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import PrefixCache
from engine.kv.pool import ReqToTokenPool
from engine.scheduler.admission import Admission, SchedulerConfig, decode_prefix_lens
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.lookahead import lookahead_rows, sampling_reads_last_token
from engine.scheduler.new_token_ratio import NewTokenRatio
from engine.scheduler.queues import RequestQueues
from engine.scheduler.request import Req
from engine.scheduler.retraction import Retraction
from engine.scheduler.slots import KVSlots

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler(RequestQueues):
    def __init__(
        self,
        config: SchedulerConfig,
        tree_cache: PrefixCache,
        allocator: TokenSlotAllocator,
        req_to_token_pool: ReqToTokenPool,
    ) -> None:
        super().__init__(tree_cache)
        self.config = config
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.slots = KVSlots(allocator, tree_cache, req_to_token_pool)
        self.forecast = NewTokenRatio(config.schedule_conservativeness)
        self.admission = Admission(config, self, self.slots, self.forecast)
        self.retraction = Retraction(self, self.slots, self.forecast)

    @property
    def new_token_ratio(self) -> float:
        return self.forecast.value

    @property
    def num_retractions(self) -> int:
        return self.retraction.count

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduleBatch]:
        self.finish_marked_aborts()
        batch = self.admission.prefill_batch()
        if batch is not None:
            return batch
        return self._decode_batch()

    def _decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        self.retraction.until_fits()
        if not self.running:
            return None
        slots = self.slots.alloc(len(self.running))
        assert slots is not None, "retraction left too few free slots"
        reqs = list(self.running)
        return self._decode_schedule_batch(reqs, decode_prefix_lens(reqs), slots, lookahead=False)

    def schedule_lookahead(self, inflight: ScheduleBatch) -> Optional[ScheduleBatch]:
        """The next decode step over `inflight`'s requests, before its tokens are known (see
        engine/scheduler/lookahead.py); None when the step must wait for them."""
        rows = lookahead_rows(self, inflight)
        if rows is None:
            return None
        reqs = [inflight.reqs[i] for i in rows]
        slots = self.allocator.alloc(len(reqs))
        prefix_lens = [inflight.prefix_lens[i] + 1 for i in rows]
        batch = self._decode_schedule_batch(reqs, prefix_lens, slots, lookahead=True)
        batch.lookahead_rows = rows
        batch.sample_after_commit = any(sampling_reads_last_token(r) for r in reqs)
        return batch

    def _decode_schedule_batch(self, reqs: list[Req], prefix_lens: list[int], slots: torch.Tensor,
                               lookahead: bool) -> ScheduleBatch:
        self.slots.write_decode(reqs, prefix_lens, slots)
        self.forecast.decay()
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix_lens, [1] * len(reqs), slots, lookahead=lookahead)

    def retract_all(self) -> None:
        """Every running request and the chunked one back to the queue (pause, mode retract)."""
        self.retraction.retract_all()

    # ---- results -------------------------------------------------------------------------------
    def commit(self, batch: ScheduleBatch, next_token_ids: list[int]) -> list[Req]:
        """Record a finished forward pass; returns the requests that gained a token."""
        grown: list[Req] = []
        kept = batch.samples_kept()
        for i, (req, token, keep) in enumerate(zip(batch.reqs, next_token_ids, kept)):
            if req.finished:  # ended while this lookahead step was in flight: drop its slot
                self.allocator.free(batch.out_cache_loc[i : i + 1])
                continue
            req.kv_committed_len = batch.prefix_lens[i] + batch.extend_lens[i]
            if batch.lookahead:
                req.fill_all()
            if batch.forward_mode is ForwardMode.EXTEND and i < batch.num_prefill_rows:
                self.tree_cache.cache_unfinished_req(req)
                if req.is_chunked:
                    self.chunked_req = req
                    continue
                self.running.append(req)
            if keep:
                req.output_ids.append(token)
                grown.append(req)
        return grown

    def fail_batch(self, batch: ScheduleBatch, message: str, slots_committed: bool) -> list[Req]:
        """Ends the requests of a batch whose forward pass failed, without leaking KV slots."""
        if not slots_committed:
            self.allocator.free(batch.out_cache_loc)
        failed = []
        for req in batch.reqs:
            if req.finished:
                continue
            self.release(req)
            req.finished_reason = abort_reason(message)
            failed.append(req)
        return failed

    def flush_cache(self) -> bool:
        if self.num_holding_kv():
            return False
        self.tree_cache.reset()
        return True

    def check_integrity(self) -> None:
        self.slots.check_integrity(self.active())
