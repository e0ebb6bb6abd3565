"""PayloadOpener on its own: updates are opened on threads, refused at their deadline, and the
threads a hung sender holds are capped (engine/core/payload_opener.py)."""

from __future__ import annotations

import threading
import time

from engine.core.messages import UpdateWeightsReq
from engine.core.payload_opener import MAX_OPENING, PayloadOpener


class _Source:
    def __init__(self, gate: threading.Event, result="opened", error=None):
        self.gate, self.result, self.error = gate, result, error

    def open(self):
        self.gate.wait(30)
        if self.error is not None:
            raise self.error
        return self.result


def _drain(opener: PayloadOpener, until: float) -> list:
    out = []
    while opener.pending and time.monotonic() < until:
        opener.wait(0.05)
        out += opener.finished()
    return out


def test_opened_updates_come_back_with_their_source_and_failures_as_refusals():
    opener, gate = PayloadOpener(timeout_s=10), threading.Event()
    good = UpdateWeightsReq(_Source(gate), flush_cache=False, weight_version="v")
    bad = UpdateWeightsReq(_Source(gate, error=ValueError("payload refused: it names os.system")))
    assert opener.wants(good) and not opener.wants(UpdateWeightsReq(object()))
    assert opener.start(good, 1) is None and opener.start(bad, 2) is None
    assert opener.finished() == [] and opener.pending
    gate.set()
    done = sorted(_drain(opener, time.monotonic() + 10), key=lambda item: item[1])
    (msg, call_id, refusal), (none, bad_id, reason) = done
    assert call_id == 1 and refusal is None and msg.source == "opened" and msg.weight_version == "v"
    assert msg.flush_cache is False and none is None and bad_id == 2 and reason == "payload refused: it names os.system"


def test_a_hung_open_is_refused_at_its_deadline_and_hung_threads_are_capped():
    opener, gate = PayloadOpener(timeout_s=0.3), threading.Event()
    try:
        start = time.monotonic()
        for call_id in range(MAX_OPENING):
            assert opener.start(UpdateWeightsReq(_Source(gate)), call_id) is None
        refused = opener.start(UpdateWeightsReq(_Source(gate)), 99)
        assert refused is not None and f"at most {MAX_OPENING} at once" in refused
        done = _drain(opener, start + 5)
        assert 0.25 <= time.monotonic() - start < 2.0
        assert sorted(c for _, c, _ in done) == list(range(MAX_OPENING))
        assert all(m is None and "could not be opened within 0.3 s" in r for m, _, r in done)
        assert "at most" in opener.start(UpdateWeightsReq(_Source(gate)), 100)  # still held by the hung ones
    finally:
        gate.set()
    deadline, open_gate = time.monotonic() + 10, threading.Event()
    open_gate.set()
    while opener.start(UpdateWeightsReq(_Source(open_gate)), 101) is not None:  # freed once they end
        assert time.monotonic() < deadline
        time.sleep(0.05)
