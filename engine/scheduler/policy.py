"""Waiting-queue order: fcfs, or lpm (longest cached prefix first, as SGLang)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterable

from engine.scheduler.request import Req

if TYPE_CHECKING:
    from engine.kv.base import PrefixCache

# Sorting by prefix match walks the tree for every waiting request; past this many, the CPU cost
# outweighs the hit-rate gain and lpm falls back to fcfs (SGLang's threshold).
LPM_MAX_WAITING = 128


def order_waiting(waiting: deque[Req], policy: str, tree_cache: "PrefixCache") -> tuple[Iterable[Req], bool]:
    """Returns the requests in admission order, and whether that is the queue's own order."""
    if policy == "fcfs" or len(waiting) > LPM_MAX_WAITING:
        return iter(waiting), True
    matched = {id(r): len(tree_cache.match_prefix(r.all_ids[:-1], r.cache_namespace).indices) for r in waiting}
    return sorted(waiting, key=lambda r: -matched[id(r)]), False
