"""Bounded waits (issue 14, item 4): a weight-group rendezvous runs off the core loop, so
generation goes on while it waits, and it fails within the timeout the caller gave when nobody
listens at the address (it used to block the core for up to 600 s)."""

from __future__ import annotations

import threading
import time

import pytest
from engine.models.parallel_state import free_port

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def eng(engine_factory):
    return engine_factory()


def test_a_rendezvous_to_a_dead_address_fails_in_time_while_generation_goes_on(eng):
    expected = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
    reply: list = []
    start = time.monotonic()
    joiner = threading.Thread(target=lambda: reply.append(eng.init_weights_update_group(
        "127.0.0.1", free_port(), 1, 2, "dead", backend="gloo", timeout_s=2)))
    joiner.start()
    latencies = []
    while joiner.is_alive() and time.monotonic() - start < 10:
        t0 = time.monotonic()
        out = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        latencies.append(time.monotonic() - t0)
        assert out["output_ids"] == expected
    joiner.join(timeout=10)
    elapsed = time.monotonic() - start
    ok, message = reply[0]
    assert not ok and message.startswith("Failed to init weight update group 'dead'"), message
    assert "Traceback" not in message and "frame #" not in message  # one line, not c10d's backtrace
    assert 1.5 <= elapsed <= 4.0, elapsed  # the timeout (2 s), plus a poll and a step at most
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies  # served during the wait
    # the name is free again, and the engine holds no half-formed group
    assert eng.destroy_weights_update_group("dead") == (False, "group 'dead' not found")
    eng.check_integrity()


def test_bad_arguments_and_a_second_join_are_refused_at_once(eng):
    start = time.monotonic()
    ok, message = eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", backend="mpi")
    assert not ok and "backend must be one of nccl, gloo" in message
    ok, message = eng.init_weights_update_group("127.0.0.1", free_port(), 5, 2, "g", backend="gloo")
    assert not ok and "rank 5 is outside a group of world_size 2" in message
    ok, message = eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", backend="gloo", timeout_s=0)
    assert not ok and "timeout_s must be > 0" in message
    assert time.monotonic() - start < 1.0

    port = free_port()
    first: list = []
    joiner = threading.Thread(target=lambda: first.append(eng.init_weights_update_group(
        "127.0.0.1", port, 1, 2, "busy", backend="gloo", timeout_s=2)))
    joiner.start()
    time.sleep(0.3)
    assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, "busy", backend="gloo") == \
        (False, "weight update group 'busy' is still forming")
    assert eng.destroy_weights_update_group("busy") == (True, "group 'busy' destroyed (its rendezvous was still running)")
    joiner.join(timeout=10)
    ok, message = first[0]
    assert not ok and "no weight update group 'busy' is forming" in message  # destroyed under it


def test_an_address_that_does_not_resolve_says_so_before_the_timeout(eng):
    """The rendezvous used to wait out timeout_s and then blame the trainer for not listening."""
    start = time.monotonic()
    ok, message = eng.init_weights_update_group("bad host name!", free_port(), 1, 2, "unresolved", backend="gloo",
                                                timeout_s=20)
    assert not ok and "master_address 'bad host name!' does not resolve to an address" in message, message
    assert time.monotonic() - start < 15
    assert eng.destroy_weights_update_group("unresolved") == (False, "group 'unresolved' not found")
