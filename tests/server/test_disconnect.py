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


def test_staying_clients_are_served_while_a_third_leave(engine_factory, live_server_factory):
    eng = engine_factory()
    server = live_server_factory(eng)
    stay_tokens = 16

    async def client(i: int, http: httpx.AsyncClient) -> int:
        leaver = i % 3 == 0
        params = LONG if leaver else {**LONG, "max_new_tokens": stay_tokens}
        body = {"input_ids": [5 + i % 50, 6, 7], "sampling_params": params, "stream": True}
        chunks = 0
        async with http.stream("POST", "/generate", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if leaver and chunks == 3:
                        return -1
                    last = json.loads(line[6:])
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        return len(last["output_ids"])

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*[client(i, http) for i in range(30)])

    start = time.monotonic()
    results = asyncio.run(run())
    assert results.count(-1) == 10 and all(n == stay_tokens for n in results if n != -1)
    assert time.monotonic() - start < 30
    wait_until(lambda: idle(eng), timeout=5)
    assert eng.get_stats().num_generated_tokens < 20 * stay_tokens + 10 * 500
    assert_freed(eng)
