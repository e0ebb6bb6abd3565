"""Comparing outputs bit for bit: unique token sequences and logprob differences."""

from __future__ import annotations

import math
import struct
from typing import Any, Optional, Sequence


def logprob_values(output: dict, key: str = "output_token_logprobs") -> list[Optional[float]]:
    """The values of meta_info[key] ([[logprob, token_id, text], ...]); [] when absent."""
    return [entry[0] for entry in output.get("meta_info", {}).get(key) or []]


def same_bits(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return struct.pack("<d", a) == struct.pack("<d", b)


def first_diff(a: Sequence[Any], b: Sequence[Any], equal=lambda x, y: x == y) -> Optional[int]:
    """The first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if not equal(x, y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def first_bit_diff(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Optional[int]:
    return first_diff(a, b, same_bits)


def abs_delta(a: Optional[float], b: Optional[float]) -> float:
    if same_bits(a, b):
        return 0.0
    if a is None or b is None:
        return math.inf
    d = abs(a - b)
    return math.inf if math.isnan(d) else d  # nan vs number, or -0.0 vs 0.0 (then d == 0)


def max_abs_delta(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> float:
    """max |a_i - b_i|; inf when the lengths differ."""
    if len(a) != len(b):
        return math.inf
    return max((abs_delta(x, y) for x, y in zip(a, b)), default=0.0)


class OutputTally:
    """Outputs grouped by a key (one prompt each): unique token sequences per key, and the
    largest logprob difference against the key's first output, over the positions before the
    first differing token (after it the logprobs are of different tokens)."""

    def __init__(self) -> None:
        self._seen: dict[str, set[tuple[int, ...]]] = {}
        self._first: dict[str, tuple[list[int], list[Optional[float]]]] = {}
        self.max_delta = 0.0
        self.count = 0

    def add(self, key: str, output: dict) -> None:
        ids, lps = list(output["output_ids"]), logprob_values(output)
        self._seen.setdefault(key, set()).add(tuple(ids))
        ref_ids, ref_lps = self._first.setdefault(key, (ids, lps))
        upto = first_diff(ids, ref_ids)
        n = min(len(lps), len(ref_lps)) if upto is None else upto
        self.max_delta = max(self.max_delta, max_abs_delta(lps[:n], ref_lps[:n]))
        self.count += 1

    def unique_counts(self) -> dict[str, int]:
        return {key: len(seqs) for key, seqs in self._seen.items()}
