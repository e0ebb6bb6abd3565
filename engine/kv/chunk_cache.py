"""ChunkCache: the no-sharing cache used with --disable-radix-cache. A request keeps owning
its own slots (so chunked prefill still works) and frees them when it finishes."""

from __future__ import annotations

from typing import Any

import torch

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import MatchResult, PrefixCache
from engine.kv.pool import ReqToTokenPool
from engine.kv.radix_cache import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class ChunkCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool | None):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.root = TreeNode()  # dummy; lets callers lock/unlock unconditionally

    def match_prefix(self, key: list[int], namespace: Any = None) -> MatchResult:
        return MatchResult(_EMPTY.clone(), self.root)

    def insert(self, key: list[int], value: torch.Tensor, namespace: Any = None) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def held_by_request(self, req: Any) -> int:
        return req.kv_committed_len  # its "prefix" is its own row, never shared

    def cache_unfinished_req(self, req: Any) -> None:
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        req.prefix_indices = row[: len(req.fill_ids)].to("cpu", copy=True)
        req.last_node = self.root

    def cache_finished_req(self, req: Any) -> None:
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.allocator.free(row[: req.kv_committed_len].to("cpu", copy=True))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
