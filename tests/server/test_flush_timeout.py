"""/flush_cache?timeout=S (SGLang 0.5.23): a flush asked for while requests run waits up to S
seconds for them to end instead of failing at once; a timeout that is not a number of seconds is
a 400 naming it."""

from __future__ import annotations

import threading
import time

import pytest

LONG = {"max_new_tokens": 1500, "temperature": 0.0, "ignore_eos": True}


def test_a_flush_waits_for_the_running_request(engine, client):
    done = threading.Event()
    worker = threading.Thread(target=lambda: (engine.generate(input_ids=[5, 6, 7], sampling_params=LONG),
                                              done.set()))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not engine.get_stats().num_running_reqs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not done.is_set(), "the request ended before the flush could meet it: make it longer"
        now = client.post("/flush_cache")
        assert now.status_code == 400 and "running or waiting" in now.text
        waited = client.post("/flush_cache?timeout=60")
        assert waited.status_code == 200 and waited.text.startswith("Cache flushed.")
        assert done.is_set() or not engine.get_stats().num_running_reqs
    finally:
        worker.join(60)
    assert client.get("/flush_cache?timeout=0").status_code == 200  # idle: flushed at the first try


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "1e9"])
def test_a_timeout_that_is_not_seconds_is_refused(client, value):
    resp = client.post(f"/flush_cache?timeout={value}")
    assert resp.status_code == 400 and "timeout must be a number of seconds" in resp.text
