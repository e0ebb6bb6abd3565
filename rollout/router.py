"""PrefixRouter: which engine replica takes a prompt's group of samples.

Two goals pull apart. Prefix locality: prompts sharing their first `route_prefix` tokens (a system
prompt, a few-shot header) should meet on one engine, whose radix cache then computes that prefix
once. Balance: when most prompts share one prefix (a fixed system prompt is the common case),
locality alone sends everything to one replica. So routing is consistent hashing with bounded
loads (Mirrokni, Thorup, Zadimoghaddam 2018): a prefix goes to an engine that already holds it
(its "homes") while that engine's load stays within (1 + slack) x the mean load; otherwise, and
for a prefix not seen before, the least-loaded engine takes it (ties: a home first, then the
prefix hash's own order, so equal loads give plain prefix hashing). The load is the samples in
flight (a group of n counts n), released as groups finish. A group is one request with `n`, so it
never splits across engines. No clock, no randomness: the same sequence routes the same way.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from typing import Sequence


class PrefixRouter:
    def __init__(self, num_engines: int, route_prefix: int = 64, slack: float = 0.25,
                 max_prefixes: int = 1 << 16) -> None:
        if num_engines < 1:
            raise ValueError("PrefixRouter needs at least one engine")
        if slack < 0:
            raise ValueError(f"slack must be >= 0; got {slack}")
        self.num_engines, self.route_prefix, self.slack = num_engines, route_prefix, slack
        self.load = [0] * num_engines  # samples in flight per engine
        self._homes: OrderedDict[bytes, list[int]] = OrderedDict()  # prefix -> engines that took it, LRU
        self._max_prefixes = max_prefixes
        self._lock = threading.Lock()  # managers may route from several threads (one event loop each)

    def key(self, prompt_ids: Sequence[int]) -> bytes:
        head = ",".join(map(str, prompt_ids[: self.route_prefix])).encode()
        return hashlib.blake2b(head, digest_size=8).digest()  # (crc32's low bits are linear in the input)

    def preferred(self, prompt_ids: Sequence[int]) -> int:
        """Where a prompt goes when every engine is equally loaded: its prefix hash's engine."""
        return int.from_bytes(self.key(prompt_ids), "little") % self.num_engines

    def pick(self, prompt_ids: Sequence[int], weight: int = 1, exclude: Sequence[int] = ()) -> int:
        """The engine for a group of `weight` samples; counted in its load until `release`.
        exclude: engines not to use (a retry after they failed it)."""
        with self._lock:
            return self._pick(self.key(prompt_ids), weight, set(exclude))

    def release(self, engine: int, weight: int = 1) -> None:
        with self._lock:
            self.load[engine] -= weight

    def _pick(self, key: bytes, weight: int, exclude: set) -> int:
        homes = self._homes.pop(key, [])
        capacity = (1 + self.slack) * (sum(self.load) + weight) / self.num_engines
        usable = [e for e in range(self.num_engines) if e not in exclude] or list(range(self.num_engines))
        engine = next((e for e in homes if e in usable and self.load[e] + weight <= math.ceil(capacity)), None)
        if engine is None:  # unseen, or every home is full: the least loaded takes it
            first = int.from_bytes(key, "little") % self.num_engines
            order = {e: (e - first) % self.num_engines for e in range(self.num_engines)}
            engine = min(usable, key=lambda e: (self.load[e], e not in homes, order[e]))
        if engine not in homes:
            homes.append(engine)
        self._homes[key] = homes  # most recently used last
        if len(self._homes) > self._max_prefixes:
            self._homes.popitem(last=False)
        self.load[engine] += weight
        return engine
