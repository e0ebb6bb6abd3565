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
import engine.grammar.vocab_mask as vocab_mask
from engine.grammar.mask_prefetch import MaskPrefetch
from engine.grammar.vocab_mask import MaskFill


class LiveGrammar:
    matcher = None

    def is_terminated(self) -> bool:
        return False


@pytest.fixture
def slow_fill(monkeypatch):
    calls = {"entered": [], "release": threading.Event(), "fail": False}

    def prepare(grammars, ring):
        if not any(grammars):
            return None
        return MaskFill(torch.zeros((len(grammars), 1), dtype=torch.int32), list(grammars), list(range(len(grammars))))

    class SlowMatcher:  # stands for xgrammar's BatchGrammarMatcher, under vocab_mask.run_fill
        def batch_fill_next_token_bitmask(self, matchers, bitmask, rows):
            calls["entered"].append(time.perf_counter())
            calls["release"].wait(5)
            bitmask[:1].fill_(7)  # a half-written mask, if it then fails
            if calls["fail"]:
                raise RuntimeError("fill failed")
            bitmask.fill_(len(calls["entered"]))

    monkeypatch.setattr(mask_prefetch, "prepare_fill", prepare)
    monkeypatch.setattr(vocab_mask, "_batch_matcher", SlowMatcher)
    return calls


class FakeGate:
    """Records what the device would be told: waits queued, and the worker's opens."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts, self.waits, self.opens = accepts, [], []

    def wait(self, seq: int) -> bool:
        self.waits.append(seq)
        return self.accepts

    def open(self, seq: int) -> None:
        self.opens.append(seq)


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


def test_with_a_gate_take_does_not_wait_and_the_worker_opens_it(slow_fill):
    gate = FakeGate()
    prefetch = MaskPrefetch(gate)
    batch = object()
    for n in range(1, 3):
        prefetch.start(batch, [LiveGrammar()], ring=None)
        mask = prefetch.take(batch)  # the fill is still blocked: the device is told to wait instead
        assert gate.waits == list(range(1, n + 1)) and gate.opens == list(range(1, n))
        assert mask.tolist() == [[0]]
        slow_fill["release"].set()
        prefetch.drop()  # the core joins the worker before it next reads the device
        assert gate.opens == list(range(1, n + 1)) and mask.tolist() == [[n]]
        slow_fill["release"].clear()
    assert prefetch.num_taken == 2
    prefetch.shutdown()


def test_a_failed_gated_fill_opens_the_gate_on_a_mask_that_allows_everything(slow_fill, caplog):
    gate = FakeGate()
    prefetch = MaskPrefetch(gate)
    slow_fill["fail"] = True
    slow_fill["release"].set()
    prefetch.start(batch := object(), [LiveGrammar()], ring=None)
    mask = prefetch.take(batch)
    prefetch.drop()
    assert gate.opens == [1] and mask.tolist() == [[-1]]
    assert "grammar mask fill failed" in caplog.text
    prefetch.shutdown()


def test_a_gate_the_driver_refuses_falls_back_to_waiting_on_the_host(slow_fill):
    gate = FakeGate(accepts=False)
    prefetch = MaskPrefetch(gate)
    slow_fill["release"].set()
    prefetch.start(batch := object(), [LiveGrammar()], ring=None)
    assert prefetch.take(batch).tolist() == [[1]] and gate.opens == [1]
    prefetch.shutdown()


def test_without_the_hand_off_start_returns_at_once_and_the_fill_still_lands(slow_fill):
    gate = FakeGate()
    prefetch = MaskPrefetch(gate)
    prefetch.hand_off = False
    batch = object()
    for n in range(1, 3):
        prefetch.start(batch, [LiveGrammar()], ring=None)
        mask = prefetch.take(batch)
        slow_fill["release"].set()
        prefetch.drop()
        assert mask.tolist() == [[n]] and gate.opens == list(range(1, n + 1))
        slow_fill["release"].clear()
    prefetch.hand_off = True  # switching back keeps the hand-off's locks paired
    prefetch.start(batch, [LiveGrammar()], ring=None)
    assert len(slow_fill["entered"]) == 3
    slow_fill["release"].set()
    prefetch.shutdown()


def test_no_stream_gate_off_cuda():
    from engine.grammar.stream_gate import StreamGate

    assert StreamGate.create("cpu") is None  # the CPU path waits for the fill on the host
