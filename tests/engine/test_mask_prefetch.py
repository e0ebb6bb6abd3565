"""MaskPrefetch (engine/grammar/mask_prefetch.py): the fill really runs in the background.

The fill is replaced by one that records when it starts and sleeps (releasing the GIL, as
xgrammar's fill does), so the test sees the hand-off itself: the worker must have entered the
fill before `start` returns, or it would only run once the core thread blocks (CPython hands a
woken thread the GIL after a 5 ms switch interval at the earliest).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import engine.grammar.mask_prefetch as mask_prefetch
from engine.grammar.mask_prefetch import MaskPrefetch


class LiveGrammar:
    matcher = None

    def is_terminated(self) -> bool:
        return False


@pytest.fixture
def slow_fill(monkeypatch):
    calls = {"entered": [], "release": threading.Event(), "fail": False}
    monkeypatch.setattr(mask_prefetch, "prepare_fill", lambda grammars, ring: grammars if any(grammars) else None)

    def fill(grammars):
        calls["entered"].append(time.perf_counter())
        calls["release"].wait(5)
        if calls["fail"]:
            raise RuntimeError("fill failed")
        return torch.full((len(grammars), 1), len(calls["entered"]), dtype=torch.int32)

    monkeypatch.setattr(mask_prefetch, "run_fill", fill)
    return calls


def test_the_worker_is_filling_when_start_returns(slow_fill):
    prefetch = MaskPrefetch()
    batch = object()
    for n in range(1, 4):
        prefetch.start(batch, [LiveGrammar(), None], ring=None)
        assert len(slow_fill["entered"]) == n  # no blocking call ran on this thread since start
        slow_fill["release"].set()
        assert prefetch.take(batch).tolist() == [[n], [n]]
        slow_fill["release"].clear()
    assert prefetch.num_taken == 3
    prefetch.shutdown()


def test_a_prefetch_for_another_batch_or_a_failed_one_is_not_taken(slow_fill):
    prefetch = MaskPrefetch()
    slow_fill["release"].set()
    prefetch.start(first := object(), [LiveGrammar()], ring=None)
    assert prefetch.take(object()) is None  # another batch: dropped, filled on the core thread
    assert prefetch.take(first) is None  # already dropped
    slow_fill["fail"] = True
    prefetch.start(first, [LiveGrammar()], ring=None)
    assert prefetch.take(first) is None  # the core thread fills it again and sees the error itself
    prefetch.start(first, [None, None], ring=None)  # no live grammar: nothing to fill
    assert prefetch.take(first) is None and len(slow_fill["entered"]) == 2
    assert prefetch.num_taken == 0
    prefetch.shutdown()
