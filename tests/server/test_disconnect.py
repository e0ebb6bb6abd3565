"""A client that leaves cancels its requests (streamed or not): KV is freed at once and the
clients that stay are served as if the leavers had never come. Real sockets (uvicorn on a
thread): TestClient cannot disconnect."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

LONG = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}


def wait_until(predicate, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached"
        time.sleep(0.01)
    return time.monotonic() - start


def idle(engine) -> bool:
    stats = engine.get_stats()
    return stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def assert_freed(engine) -> None:
    """Nothing runs, and with the cache flushed every KV slot is free again."""
    assert engine.flush_cache()
    engine.check_integrity()
    stats = engine.get_stats()
    assert stats.kv_tokens_used <= 1, stats  # slot 0 is the padding slot


def test_streaming_client_that_leaves_frees_its_kv(engine_factory, live_server_factory):
    eng = engine_factory()
    server = live_server_factory(eng)
    for path, body in [("/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": LONG, "stream": True}),
                       ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True,
                                            "temperature": 0, "ignore_eos": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                                 "max_tokens": 3000, "temperature": 0, "ignore_eos": True})]:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for _ in range(3):  # a few tokens, then go away
                    next(line for line in lines if line.startswith("data: "))
        left_at = eng.get_stats().num_generated_tokens
        assert wait_until(lambda: idle(eng)) < 2.0, path
        assert eng.get_stats().num_generated_tokens - left_at < 500  # not decoded on for nobody
        assert_freed(eng)


def test_non_streaming_client_that_leaves_frees_its_kv(engine_factory, live_server_factory):
    eng = engine_factory()
    server = live_server_factory(eng)
    for path, body in [("/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": LONG}),
                       ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3000, "temperature": 0,
                                            "ignore_eos": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 3000, "temperature": 0, "ignore_eos": True})]:
        with httpx.Client(base_url=server.url, timeout=0.5) as http:  # the client gives up
            try:
                http.post(path, json=body)
                raise AssertionError(f"{path} answered before the client's timeout")
            except httpx.ReadTimeout:
                pass
        assert wait_until(lambda: idle(eng)) < 2.0, path
        assert_freed(eng)


STREAMS = 200
STAY_TOKENS = 8


async def _stream_client(i: int, http: httpx.AsyncClient, leaver: bool, start: float) -> float:
    """One streamed /generate: a leaver reads 3 chunks of a long request and goes away (-1); a
    stayer reads to the end and returns when it finished (seconds after `start`)."""
    params = LONG if leaver else {**LONG, "max_new_tokens": STAY_TOKENS}
    body = {"input_ids": [5 + i % 50, 6, 7], "sampling_params": params, "stream": True}
    chunks, last = 0, None
    async with http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if leaver and chunks == 3:
                    return -1.0
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == STAY_TOKENS
    return time.monotonic() - start


def _run_streams(url: str, leavers: bool, timeout: float = 60.0) -> list[float]:
    """STREAMS clients at once (every third one a leaver when `leavers`; otherwise those slots
    stay empty): the stayers' finishing times, -1 for each leaver."""
    async def run() -> list[float]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
            start = time.monotonic()
            clients = [_stream_client(i, http, i % 3 == 0, start) for i in range(STREAMS)
                       if leavers or i % 3 != 0]
            return await asyncio.gather(*clients)

    return asyncio.run(run())


def test_200_streams_with_a_third_leaving_finish_as_fast_as_without_them(engine_factory, live_server_factory):
    """Issue 14: 200 concurrent streams, 67 leave after 3 chunks of a 3000-token request. The
    133 that stay finish in about the time they take alone (measured here, same engine), and the
    leavers decode nothing for nobody: the engine is idle right after and every KV slot is free."""
    eng = engine_factory()
    server = live_server_factory(eng)
    _run_streams(server.url, leavers=False)  # warm-up: first-step costs out of the timings
    alone = max(_run_streams(server.url, leavers=False))
    tokens_before = eng.get_stats().num_generated_tokens
    # leavers decoded on for nobody stall the stayers for minutes (issue 14): fail fast instead
    results = _run_streams(server.url, leavers=True, timeout=5 * alone + 10)
    stayers = [t for t in results if t >= 0]
    assert len(stayers) == 133 and results.count(-1.0) == 67
    with_leavers = max(stayers)
    # the leavers' prompts are prefilled and their first chunks decoded, so the stayers pay some
    # time for them (measured on 2 cores: 4.2-4.6 s vs 2.2-3.4 s alone, at this and the previous
    # release); decoding on for nobody (issue 14) costs minutes, and the token count below is exact
    assert with_leavers <= 2.0 * alone + 1.0, (with_leavers, alone)
    assert wait_until(lambda: idle(eng), timeout=5) < 2.0  # leavers were aborted, not decoded on
    # stayers' tokens plus a few steps per leaver (3 read, a step or two before the abort lands)
    assert eng.get_stats().num_generated_tokens - tokens_before < 133 * STAY_TOKENS + 67 * 50
    assert_freed(eng)
