"""Scheduler: waiting queue, prefill admission, decode batches, retraction. Host-only.

Each step is either a prefill batch (requests admitted by PrefillAdder, the chunked request
first) or a decode batch of every running request. Prefill goes first, as in SGLang.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import PrefixCache
from engine.kv.pool import ReqToTokenPool
from engine.scheduler.lookahead import lookahead_rows, sampling_reads_last_token
from engine.scheduler.new_token_ratio import NewTokenRatio
from engine.scheduler.prefill_adder import PrefillAdder, never_fits
from engine.scheduler.request import Req
from engine.forward_batch import ForwardMode
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.policy import order_waiting

logger = logging.getLogger(__name__)

SIBLING_PREFIX = 32  # shared uncached tokens at which a sibling is held back one round
MAX_DEFERRED_PER_STEP = 128


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: Optional[int]
    max_prefill_tokens: int
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        tree_cache: PrefixCache,
        allocator: TokenSlotAllocator,
        req_to_token_pool: ReqToTokenPool,
    ) -> None:
        self.config = config
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.forecast = NewTokenRatio(config.schedule_conservativeness)
        self.num_retractions = 0
        self.finished_here: list[Req] = []

    @property
    def new_token_ratio(self) -> float:
        return self.forecast.value

    # ---- queue ---------------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def abort_request(self, rid: str, message: str = "aborted") -> Optional[Req]:
        """Waiting requests finish now; running ones are marked and released by the core."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort", "message": message}
                return req
        for req in self._active():
            if req.rid == rid:
                req.to_abort = message
                return req
        return None

    def pop_finished(self) -> list[Req]:
        """Requests the scheduler itself ended (aborted while running, or out of memory)."""
        done, self.finished_here = self.finished_here, []
        return done

    def finish_marked_aborts(self) -> None:
        for req in [r for r in self._active() if r.to_abort is not None]:
            self.release(req)
            req.finished_reason = {"type": "abort", "message": req.to_abort}
            self.finished_here.append(req)

    def _active(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req else [])

    # ---- schedule ------------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduleBatch]:
        self.finish_marked_aborts()
        batch = self._prefill_batch()
        if batch is not None:
            return batch
        return self._decode_batch()

    def _prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting and self.chunked_req is None:
            return None
        adder = PrefillAdder(
            self.allocator, self.tree_cache, self.running, self.new_token_ratio,
            self.config.chunked_prefill_size, self.config.max_prefill_tokens,
        )
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            req.fill_ids = req.all_ids
            adder.add_chunked(req)
        ordered, in_queue_order = order_waiting(self.waiting, self.config.schedule_policy, self.tree_cache)
        admitted: list[Req] = []  # and refused: both leave the queue
        siblings: set[tuple] = set()
        deferred = 0
        for req in ordered:
            if adder.full or len(self.running) + len(adder.reqs) >= self.config.max_running_requests:
                break
            if never_fits(req, self.allocator.size):  # waiting cannot help it, nor those behind it
                self._refuse_oversized(req)
                admitted.append(req)
                continue
            if self._defer_sibling(req, siblings):
                in_queue_order, deferred = False, deferred + 1
                if deferred > MAX_DEFERRED_PER_STEP:  # bound the scan, whatever the queue length
                    break
                continue
            if self.req_to_token_pool.available_size() == 0 or not self._admit(req, adder):
                break
            admitted.append(req)
        # FCFS: a request that does not fit now stops admission (the `break` above), so it is not
        # overtaken forever by smaller ones; it waits at most until the running requests end,
        # since an empty pool fits it (never_fits refuses the rest, so none blocks the queue).
        self._remove_from_waiting(admitted, in_queue_order)
        batch = self._build_extend_batch(adder.reqs) if adder.reqs else None
        if batch is not None and self.config.enable_mixed_chunk and self.running:
            self._mix_in_decode(batch)
        return batch

    def _refuse_oversized(self, req: Req) -> None:
        """The front end refuses these (RequestBuilder); a request that still gets here ends now
        with an error naming the limit instead of waiting for memory that never comes."""
        need = len(req.all_ids) + req.remaining_new_tokens
        req.finished_reason = {"type": "abort", "status_code": 400, "message": (
            f"request needs {need} KV cache slots ({len(req.all_ids)} tokens + {req.remaining_new_tokens} "
            f"new) but the pool holds {self.allocator.size}; lower max_new_tokens or raise --max-total-tokens")}
        self.finished_here.append(req)

    def _mix_in_decode(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: running requests ride along in the prefill pass as one-token
        extends, so their streams do not stall behind a long prompt. Skipped when it would need
        retraction; the next decode step handles memory pressure."""
        reqs = list(self.running)
        if self._free_decode_tokens() < len(reqs):
            return
        slots = self._alloc_slots(len(reqs))
        if slots is None:
            return
        prefix_lens = [r.seq_len - 1 for r in reqs]
        for req in reqs:
            req.fill_ids = req.all_ids
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.req_to_token_pool.write_decode(rows, torch.tensor(prefix_lens, dtype=torch.int64), slots)
        batch.reqs += reqs
        batch.prefix_lens += prefix_lens
        batch.extend_lens += [1] * len(reqs)
        batch.out_cache_loc = torch.cat([batch.out_cache_loc, slots])
        batch.num_decode_rows = len(reqs)
        self.forecast.decay()

    def _remove_from_waiting(self, admitted: list[Req], in_queue_order: bool) -> None:
        if in_queue_order:  # fcfs admits a prefix of the queue: O(admitted), not O(queue)
            for _ in admitted:
                self.waiting.popleft()
        elif admitted:
            taken = {id(r) for r in admitted}
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)

    def _defer_sibling(self, req: Req, siblings: set[tuple]) -> bool:
        """Two requests that share >= SIBLING_PREFIX uncached tokens should not both compute them:
        the second waits one round and then reads the shared part from the tree (SGLang's
        in-batch prefix trick; it is what makes n > 1 groups hit the cache)."""
        ids = req.all_ids
        start = len(self.tree_cache.match_prefix(ids[:-1]).indices)
        if len(ids) - start <= SIBLING_PREFIX:
            return False
        key = (start, tuple(ids[start : start + SIBLING_PREFIX]))
        if key in siblings:
            return True
        siblings.add(key)
        return False

    def _admit(self, req: Req, adder: PrefillAdder) -> bool:
        req.fill_ids = req.all_ids
        match = self.tree_cache.match_prefix(req.fill_ids[: req.max_prefix_len()])
        self.tree_cache.inc_lock_ref(match.last_node)
        if not adder.try_add(req, len(match.indices)):
            self.tree_cache.dec_lock_ref(match.last_node)
            return False
        req.prefix_indices, req.last_node = match.indices, match.last_node
        req.req_pool_idx = self.req_to_token_pool.alloc()
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
        if req.num_retractions == 0 and not req.input_logprobs_done:
            req.cached_tokens = len(match.indices)
        return True

    def _build_extend_batch(self, reqs: list[Req]) -> Optional[ScheduleBatch]:
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        extend_lens = [r.extend_input_len for r in reqs]
        slots = self._alloc_slots(sum(extend_lens))
        if slots is None:  # the forecast said it fits; if not, give everything back and wait
            for req in reqs:
                self._undo_admission(req)
            return None
        offset = 0
        for req, start, n in zip(reqs, prefix_lens, extend_lens):
            self.req_to_token_pool.write(req.req_pool_idx, start, slots[offset : offset + n])
            req.fill_ids = req.fill_ids[: start + n]
            offset += n
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, slots)

    def _undo_admission(self, req: Req) -> None:
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.is_chunked = False
        self.waiting.appendleft(req)

    def _alloc_slots(self, n: int) -> Optional[torch.Tensor]:
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def _decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        self._retract_until_fits()
        if not self.running:
            return None
        slots = self._alloc_slots(len(self.running))
        assert slots is not None, "retraction left too few free slots"
        reqs = list(self.running)
        prefix_lens = [r.seq_len - 1 for r in reqs]
        for req in reqs:
            req.fill_ids = req.all_ids
        return self._decode_schedule_batch(reqs, prefix_lens, slots, lookahead=False)

    def _decode_schedule_batch(self, reqs: list[Req], prefix_lens: list[int], slots: torch.Tensor,
                               lookahead: bool) -> ScheduleBatch:
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.req_to_token_pool.write_decode(rows, torch.tensor(prefix_lens, dtype=torch.int64), slots)
        self.forecast.decay()
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix_lens, [1] * len(reqs), slots, lookahead=lookahead)

    # ---- overlap -------------------------------------------------------------------------------
    def schedule_lookahead(self, inflight: ScheduleBatch) -> Optional[ScheduleBatch]:
        """The next decode step over `inflight`'s requests, before its tokens are known (see
        engine/lookahead.py); None when the step must wait for them."""
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

    # ---- retraction ----------------------------------------------------------------------------
    def _free_decode_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def _retract_until_fits(self) -> None:
        retracted = 0
        while self._free_decode_tokens() < len(self.running) and len(self.running) > 1:
            # least progress first: fewest output tokens, then the longest prompt
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            self._retract(victim)
            retracted += 1
        if self._free_decode_tokens() < len(self.running):
            req = self.running[-1]
            self.release(req)
            req.finished_reason = {"type": "abort", "message": "KV cache pool too small for this request; raise --max-total-tokens"}
            self.finished_here.append(req)
        if retracted:
            self.num_retractions += retracted
            old = self.forecast.after_retraction(self.running)
            logger.warning("KV cache pool is full. Retract %d requests. new_token_ratio: %.4f -> %.4f",
                           retracted, old, self.new_token_ratio)

    def retract_all(self) -> None:
        """Every running request and the chunked one back to the front of the queue, in their
        order, keeping their outputs; their KV goes to the tree, evictable (pause, mode retract)."""
        active = self._active()
        self.running, self.chunked_req = [], None
        for req in reversed(active):
            self._retract(req)

    def _retract(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)  # its KV stays in the tree, evictable
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node, req.kv_committed_len, req.is_chunked = None, 0, False
        req.num_retractions += 1
        self.waiting.appendleft(req)

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
                req.fill_ids = req.all_ids
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

    def release(self, req: Req) -> None:
        """Give back everything a finished or aborted request holds."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)

    def fail_batch(self, batch: ScheduleBatch, message: str, slots_committed: bool) -> list[Req]:
        """Ends the requests of a batch whose forward pass failed, without leaking KV slots."""
        if not slots_committed:
            self.allocator.free(batch.out_cache_loc)
        failed = []
        for req in batch.reqs:
            if req.finished:
                continue
            self.release(req)
            req.finished_reason = {"type": "abort", "message": message}
            failed.append(req)
        return failed

    def num_holding_kv(self) -> int:
        """Requests whose KV is in the pool (running, or half prefilled): a flush must wait."""
        return len(self._active())

    def flush_cache(self) -> bool:
        if self.num_holding_kv():
            return False
        self.tree_cache.reset()
        return True

    def check_integrity(self) -> None:
        """free + cached + held by requests == pool size; when idle, nothing is locked."""
        held = sum(self.tree_cache.held_by_request(r) for r in self._active())
        total = self.allocator.available_size() + self.tree_cache.total_size() + held
        assert total == self.allocator.size, f"KV slot leak: free+cached+held={total} != {self.allocator.size}"
        if not self._active():
            assert self.tree_cache.protected_size() == 0, "idle engine still holds locked cache nodes"
            assert self.req_to_token_pool.available_size() == self.req_to_token_pool.size, "leaked req rows"
        self.tree_cache.check_invariants()

