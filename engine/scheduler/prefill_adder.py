"""PrefillAdder: admits waiting requests into one prefill batch on SGLang's token forecast.

A request joins when its new tokens plus its whole remaining max_new_tokens fit in what the pool
has left after reserving, for every running request, its remaining max_new_tokens scaled by
new_token_ratio (1.0 for ignore_eos requests, which always run to their limit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler.request import Req

if TYPE_CHECKING:
    from engine.kv.allocator import TokenSlotAllocator
    from engine.kv.base import PrefixCache

# Reservation per request is clipped so one huge max_new_tokens cannot block admission forever.
CLIP_MAX_NEW_TOKENS = 4096


def never_fits(req: Req, pool_size: int) -> bool:
    """True when even an empty pool cannot admit req: the forecast charges its tokens so far
    plus its remaining max_new_tokens, whatever part of them a cached prefix already holds."""
    return req.seq_len + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) > pool_size


def reserved_tokens(req: Req, new_token_ratio: float) -> float:
    ratio = 1.0 if req.sampling_params.ignore_eos else new_token_ratio
    return min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * ratio


class PrefillAdder:
    def __init__(
        self,
        allocator: "TokenSlotAllocator",
        tree_cache: "PrefixCache",
        running: list[Req],
        new_token_ratio: float,
        chunk_budget: int | None,
        input_budget: int,
    ) -> None:
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.reserved = sum(reserved_tokens(r, new_token_ratio) for r in running)
        self.rem_chunk = chunk_budget if chunk_budget is not None else float("inf")
        self.rem_input = input_budget
        self.reqs: list[Req] = []

    @property
    def free_tokens(self) -> float:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.reserved

    @property
    def full(self) -> bool:
        return self.rem_chunk <= 0 or self.rem_input <= 0

    def try_add(self, req: Req, prefix_len: int) -> bool:
        """Charge req (already locked on its prefix) against the budgets; False if it must wait.

        On success req.extend_input_len is set, cut to the chunk budget if needed."""
        extend = req.fill_len - prefix_len
        total = extend + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
        if total > self.free_tokens:
            return False
        if self.reqs and extend > self.rem_input:
            return False
        if extend > self.rem_chunk:
            extend = int(self.rem_chunk)
            req.is_chunked = True
        else:
            req.is_chunked = False
        req.extend_input_len = extend
        self.reserved += total
        self.rem_chunk -= extend
        self.rem_input -= extend
        self.reqs.append(req)
        return True

    def add_chunked(self, req: Req) -> None:
        """The request cut by the last chunk continues first, whatever the forecast says: its
        prefix is already paid for and it holds its slots."""
        prefix_len = len(req.prefix_indices)
        extend = req.fill_len - prefix_len
        req.is_chunked = extend > self.rem_chunk
        extend = min(extend, int(self.rem_chunk)) if req.is_chunked else extend
        req.extend_input_len = extend
        self.reserved += extend + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
        self.rem_chunk -= extend
        self.rem_input -= extend
        self.reqs.append(req)
