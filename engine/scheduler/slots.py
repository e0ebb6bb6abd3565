"""KVSlots: the KV cache slots and request rows the scheduler hands out. Host-only.

Allocation evicts unlocked prefixes from the tree first, so cached KV lives until the pool
needs its room; the check at the end (free + cached + held == pool size) is what every test of
the scheduler leans on.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import PrefixCache
from engine.kv.pool import ReqToTokenPool
from engine.scheduler.request import Req


class KVSlots:
    def __init__(self, allocator: TokenSlotAllocator, tree_cache: PrefixCache,
                 req_to_token_pool: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool

    def free_for_decode(self) -> int:
        """Slots a decode step can get: free ones plus those eviction can give back."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def write_decode(self, reqs: Sequence[Req], prefix_lens: list[int], slots: torch.Tensor) -> None:
        """Each request's one new token goes to its slot, at position prefix_len of its row."""
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.req_to_token_pool.write_decode(rows, torch.tensor(prefix_lens, dtype=torch.int64), slots)

    def check_integrity(self, active: Sequence[Req]) -> None:
        """free + cached + held by requests == pool size; when idle, nothing is locked."""
        held = sum(self.tree_cache.held_by_request(r) for r in active)
        total = self.allocator.available_size() + self.tree_cache.total_size() + held
        assert total == self.allocator.size, f"KV slot leak: free+cached+held={total} != {self.allocator.size}"
        if not active:
            assert self.tree_cache.protected_size() == 0, "idle engine still holds locked cache nodes"
            assert self.req_to_token_pool.available_size() == self.req_to_token_pool.size, "leaked req rows"
        self.tree_cache.check_invariants()
