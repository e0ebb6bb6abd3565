"""Admission: the next prefill batch, taken from the waiting queue. Host-only.

The request cut by the last chunk continues first; then waiting requests in policy order join
while PrefillAdder's forecast says they fit (engine/scheduler/prefill_adder.py). Each admitted
request locks its cached prefix in the tree and gets a request row; its new tokens get KV slots
when the batch is built.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from engine.finish_reasons import abort_reason
from engine.forward_batch import ForwardMode
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.new_token_ratio import NewTokenRatio
from engine.scheduler.policy import order_waiting
from engine.scheduler.prefill_adder import PrefillAdder, never_fits
from engine.scheduler.queues import RequestQueues
from engine.scheduler.request import Req
from engine.scheduler.slots import KVSlots

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
    max_loras_per_batch: Optional[int] = None  # distinct LoRA adapters in one batch (None: no LoRA limit)


class Admission:
    def __init__(self, config: SchedulerConfig, queues: RequestQueues, slots: KVSlots,
                 forecast: NewTokenRatio) -> None:
        self.config = config
        self.queues = queues
        self.slots = slots
        self.tree_cache = slots.tree_cache
        self.forecast = forecast
        self.pinned_loras: frozenset[int] = frozenset()  # adapters holding a LoRA pool slot while loaded
        # a held weight update's cutoff: only requests queued before it start (None: all may)
        self.admit_before: Optional[int] = None

    def prefill_batch(self) -> Optional[ScheduleBatch]:
        q = self.queues
        waiting = q.waiting if self.admit_before is None else deque(
            r for r in q.waiting if r.arrival < self.admit_before)
        if not waiting and q.chunked_req is None:
            return None
        adder = PrefillAdder(self.slots.allocator, self.tree_cache, q.running, self.forecast.value,
                             self.config.chunked_prefill_size, self.config.max_prefill_tokens)
        if q.chunked_req is not None:
            req, q.chunked_req = q.chunked_req, None
            req.fill_all()
            adder.add_chunked(req)
        ordered, in_queue_order = order_waiting(waiting, self.config.schedule_policy, self.tree_cache)
        in_queue_order = in_queue_order and waiting is q.waiting  # a filtered queue's prefix is not q.waiting's
        admitted: list[Req] = []  # and refused: both leave the queue
        siblings: set[tuple] = set()
        adapters = {r.lora_id for r in list(q.running) + adder.reqs}  # None, the base model, takes a slot too
        deferred = 0
        for req in ordered:
            if adder.full or len(q.running) + len(adder.reqs) >= self.config.max_running_requests:
                break
            if not self._adapter_fits(req, adapters):  # waits for room for its adapter; as FCFS below, the
                break  # requests behind it wait too, so a steady stream of others cannot starve it
            if never_fits(req, self.slots.allocator.size):  # waiting cannot help it, nor those behind it
                self._refuse_oversized(req)
                admitted.append(req)
                continue
            if self._defer_sibling(req, siblings):
                in_queue_order, deferred = False, deferred + 1
                if deferred > MAX_DEFERRED_PER_STEP:  # bound the scan, whatever the queue length
                    break
                continue
            if self.slots.req_to_token_pool.available_size() == 0 or not self._admit(req, adder):
                break
            admitted.append(req)
            adapters.add(req.lora_id)
        # FCFS: a request that does not fit now stops admission (the `break` above), so it is not
        # overtaken forever by smaller ones; it waits at most until the running requests end,
        # since an empty pool fits it (never_fits refuses the rest, so none blocks the queue).
        _remove(q.waiting, admitted, in_queue_order)
        batch = self._build_extend_batch(adder.reqs) if adder.reqs else None
        if batch is not None and self.config.enable_mixed_chunk and q.running:
            self._mix_in_decode(batch)
        return batch

    def _adapter_fits(self, req: Req, adapters: set[Optional[int]]) -> bool:
        """--max-loras-per-batch: the running requests and this batch's use at most that many
        adapters, the base model (None) counted as one, as SGLang counts its slot; and with the
        pinned adapters, resident or not, at most that many pool slots."""
        limit = self.config.max_loras_per_batch
        if limit is None or req.lora_id in adapters:
            return True
        # pinned adapters keep their pool slots: the batch's other adapters share the rest
        unpinned = {i for i in adapters | {req.lora_id} if i is not None and i not in self.pinned_loras}
        return len(adapters) < limit and len(unpinned) + len(self.pinned_loras) <= limit

    def _refuse_oversized(self, req: Req) -> None:
        """The front end refuses these (RequestBuilder); a request that still gets here ends now
        with an error naming the limit instead of waiting for memory that never comes."""
        need = req.seq_len + req.remaining_new_tokens
        self.queues.end(req, abort_reason(
            f"request needs {need} KV cache slots ({req.seq_len} tokens + {req.remaining_new_tokens} "
            f"new) but the pool holds {self.slots.allocator.size}; lower max_new_tokens or raise "
            f"--max-total-tokens", status_code=400))

    def _defer_sibling(self, req: Req, siblings: set[tuple]) -> bool:
        """Two requests that share >= SIBLING_PREFIX uncached tokens should not both compute them:
        the second waits one round and then reads the shared part from the tree (SGLang's
        in-batch prefix trick; it is what makes n > 1 groups hit the cache)."""
        ids = req.all_ids
        start = len(self.tree_cache.match_prefix(ids[:-1], req.cache_namespace).indices)
        if len(ids) - start <= SIBLING_PREFIX:
            return False
        key = (req.cache_namespace, start, tuple(ids[start : start + SIBLING_PREFIX]))
        if key in siblings:
            return True
        siblings.add(key)
        return False

    def _admit(self, req: Req, adder: PrefillAdder) -> bool:
        req.fill_all()
        match = self.tree_cache.match_prefix(req.fill_ids[: req.max_prefix_len()], req.cache_namespace)
        self.tree_cache.inc_lock_ref(match.last_node)
        if not adder.try_add(req, len(match.indices)):
            self.tree_cache.dec_lock_ref(match.last_node)
            return False
        req.prefix_indices, req.last_node = match.indices, match.last_node
        req.req_pool_idx = self.slots.req_to_token_pool.alloc()
        self.slots.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
        if req.num_retractions == 0 and not req.input_logprobs_done:
            req.cached_tokens = len(match.indices)
        return True

    def _build_extend_batch(self, reqs: list[Req]) -> Optional[ScheduleBatch]:
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        extend_lens = [r.extend_input_len for r in reqs]
        slots = self.slots.alloc(sum(extend_lens))
        if slots is None:  # the forecast said it fits; if not, give everything back and wait
            for req in reqs:
                self._undo_admission(req)
            return None
        offset = 0
        for req, start, n in zip(reqs, prefix_lens, extend_lens):
            self.slots.req_to_token_pool.write(req.req_pool_idx, start, slots[offset : offset + n])
            req.fill_ids = req.fill_ids[: start + n]
            offset += n
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, slots)

    def _undo_admission(self, req: Req) -> None:
        self.tree_cache.dec_lock_ref(req.last_node)
        self.slots.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.is_chunked = False
        self.queues.waiting.appendleft(req)

    def _mix_in_decode(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: running requests ride along in the prefill pass as one-token
        extends, so their streams do not stall behind a long prompt. Skipped when it would need
        retraction; the next decode step handles memory pressure."""
        reqs = list(self.queues.running)
        if self.slots.free_for_decode() < len(reqs):
            return
        slots = self.slots.alloc(len(reqs))
        if slots is None:
            return
        prefix_lens = decode_prefix_lens(reqs)
        self.slots.write_decode(reqs, prefix_lens, slots)
        batch.reqs += reqs
        batch.prefix_lens += prefix_lens
        batch.extend_lens += [1] * len(reqs)
        batch.out_cache_loc = torch.cat([batch.out_cache_loc, slots])
        batch.num_decode_rows = len(reqs)
        self.forecast.decay()


def decode_prefix_lens(reqs: list[Req]) -> list[int]:
    """Running requests feed their last token: its position is the KV they already hold."""
    for req in reqs:
        req.fill_all()
    return [r.seq_len - 1 for r in reqs]


def _remove(waiting: deque[Req], admitted: list[Req], in_queue_order: bool) -> None:
    if in_queue_order:  # fcfs admits a prefix of the queue: O(admitted), not O(queue)
        for _ in admitted:
            waiting.popleft()
    elif admitted:
        taken = {id(r) for r in admitted}
        kept = [r for r in waiting if id(r) not in taken]
        waiting.clear()
        waiting.extend(kept)
