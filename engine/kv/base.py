"""PrefixCache: the interface the scheduler codes against (RadixCache, or ChunkCache when
--disable-radix-cache is set)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch


class MatchResult(NamedTuple):
    indices: torch.Tensor  # int64 CPU slots of the matched prefix
    last_node: Any  # node to lock while a request uses the prefix


class PrefixCache(ABC):
    # ---- token level ------------------------------------------------------------------------
    # namespace: the tree a key lives in (a LoRA adapter's id; None: the base model). Keys of
    # different namespaces never share a prefix.
    @abstractmethod
    def match_prefix(self, key: list[int], namespace: Any = None) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: Any = None) -> int:
        """Returns how much of key was already cached; the caller frees those duplicate slots."""

    def drop_namespace(self, namespace: Any) -> int:
        """Free every cached token of `namespace` (nothing in it locked); returns how many."""
        return 0

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens unlocked cached tokens if possible; returns tokens freed."""

    @abstractmethod
    def reset(self) -> None:
        """Flush: give every cached slot back to the allocator. Nothing may be locked."""

    # ---- sizes ------------------------------------------------------------------------------
    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    def held_by_request(self, req: Any) -> int:
        """Slots a live request owns outside the cache (for the integrity check)."""
        return req.kv_committed_len - len(req.prefix_indices)

    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent."""

    # ---- request level ----------------------------------------------------------------------
    @abstractmethod
    def cache_unfinished_req(self, req: Any) -> None:
        """After a prefill chunk: make req.fill_ids' KV reusable, update req.prefix_indices."""

    @abstractmethod
    def cache_finished_req(self, req: Any) -> None:
        """On finish: hand the request's KV to the cache (or free it) and free its row."""
