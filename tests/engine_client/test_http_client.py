"""HttpClient against tandem's HTTP server (uvicorn on a free port, over an in-process engine).

Oracles: in-process engines started on each checkpoint (greedy tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

from tests.rl_setup import ENGINE_KWARGS, GREEDY, PROMPTS, greedy_ids
from engine.models.parallel_state import free_port


@contextlib.contextmanager
def _serving(engine, **keys):
    """engine's HTTP app on a free port (uvicorn on a thread) -> its URL."""
    import uvicorn

    from engine.server.http import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, **keys), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def served(model_a):
    """(HttpClient, the Engine behind it) for an engine on checkpoint A."""
    from engine import Engine
    from engine_client.client import HttpClient

    engine = Engine(model_path=model_a, **ENGINE_KWARGS)
    with _serving(engine) as url:
        client = HttpClient(url)
        yield client, engine
        client.close()
    engine.shutdown()


def test_generate_by_ids_and_text_equals_the_engine(served, oracle_a):
    client, engine = served
    assert client.health() and client.get_weight_version() == "default"
    load = client.get_load()  # SGLang's /get_load, as ROLL reads it
    assert [sorted(rank) for rank in load] == [sorted(engine.get_load()[0])] and load[0]["num_reqs"] == 0
    assert greedy_ids(client) == greedy_ids(oracle_a)
    out = client.generate(prompt="hello world", sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == oracle_a.generate(prompt="hello world", sampling_params=GREEDY)["output_ids"]
    assert len(out["meta_info"]["output_token_logprobs"]) == 8
    processed = client.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "temperature": 0.5},
                                return_logprob=True, logprob_distribution="processed")
    assert processed["meta_info"]["logprob_distribution"] == "processed"
    ids = [7, 3, 7]  # token_ids_logprob reaches the server: the engine's values, in the order asked
    asked = dict(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True, token_ids_logprob=ids)
    want = oracle_a.generate(**asked)["meta_info"]["output_token_ids_logprobs"]
    assert client.generate(**asked)["meta_info"]["output_token_ids_logprobs"] == want
    assert asyncio.run(client.async_generate(**asked))["meta_info"]["output_token_ids_logprobs"] == want
    assert [[e[1] for e in row] for row in want] == [ids] * 8
    assert oracle_a.generate(**asked)["meta_info"]["output_token_ids_logprobs"] == want
    text = dict(prompt="hello world", sampling_params=GREEDY, return_prompt_token_ids=True)  # as in-process
    assert client.generate(**text)["prompt_token_ids"] == oracle_a.generate(**text)["prompt_token_ids"]

    async def concurrent() -> list:
        return await asyncio.gather(*[client.async_generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS])

    assert [o["output_ids"] for o in asyncio.run(concurrent())] == greedy_ids(oracle_a)
    with pytest.raises(ValueError, match="max_new_tokens"):
        client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
    with pytest.raises(ValueError, match="exactly one"):
        client.generate(sampling_params=GREEDY)
    engine.check_integrity()


@pytest.mark.parametrize("library", ["aiohttp", "httpx"])
def test_async_verbs_on_either_client_library(served, oracle_a, monkeypatch, library):
    """The async verbs run on aiohttp when installed (at 256 concurrent requests httpx's own overhead
    capped an H200 server at 0.51x of in-process), on httpx otherwise: the same answers."""
    import sys

    from engine_client.client import HttpClient

    if library == "httpx":
        monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp fails: the fallback
    else:
        pytest.importorskip("aiohttp")
    client = HttpClient(served[0].base_url)

    async def run() -> tuple:
        outs = await asyncio.gather(*[client.async_generate(input_ids=p, sampling_params=GREEDY) for p in PROMPTS])
        with pytest.raises(ValueError, match="max_new_tokens"):
            await client.async_generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
        await client.async_abort_request(rid="nobody")
        kind = type(await client._async_client()).__name__
        return [o["output_ids"] for o in outs], kind

    ids, kind = asyncio.run(run())
    assert ids == greedy_ids(oracle_a)
    assert kind == {"aiohttp": "AiohttpClient", "httpx": "HttpxClient"}[library]
    client.close()


def test_requests_wait_while_paused_and_run_on_continue(served, oracle_a):
    client, _ = served
    client.pause_generation(mode="retract")
    done: list = []
    waiter = threading.Thread(target=lambda: done.append(client.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)))
    try:
        waiter.start()
        waiter.join(0.5)
        assert not done  # queued behind the pause
        assert client.get_server_info()["internal_states"][0]["paused"]
    finally:
        client.continue_generation()
    waiter.join(30)
    assert done[0]["output_ids"] == greedy_ids(oracle_a)[0]


def test_weight_updates_from_disk_and_shared_memory_set_the_version(served, model_a, model_b, oracle_a, oracle_b):
    from safetensors.torch import load_file

    client, engine = served
    try:
        ok, message, paused = client.update_weights_from_disk(model_b, weight_version="disk-b")
        assert ok and paused == 0, message  # sglang.Engine's three values, from the route's three fields
        assert greedy_ids(client) == greedy_ids(oracle_b) and client.get_weight_version() == "disk-b"
        named_a = list(load_file(f"{model_a}/model.safetensors").items())  # serialized to shared memory
        ok, message = client.update_weights_from_tensor(named_a, weight_version="shm-a")
        assert ok, message
        assert greedy_ids(client) == greedy_ids(oracle_a) and client.get_weight_version() == "shm-a"
        ok, message = client.update_weights_from_tensor([("model.nope.weight", torch.ones(2))], weight_version="x")
        assert not ok and "unknown weight 'model.nope.weight'" in message
        assert client.get_weight_version() == "shm-a" and greedy_ids(client) == greedy_ids(oracle_a)
    finally:
        client.update_weights_from_disk(model_a, weight_version="default")
    engine.check_integrity()


def test_abort_and_flush(served):
    client, engine = served

    async def aborted() -> dict:
        task = asyncio.ensure_future(client.async_generate(input_ids=[5, 6, 7], rid="long-one",
                                                           sampling_params={**GREEDY, "max_new_tokens": 4000}))
        await asyncio.sleep(0.5)
        await client.async_abort_request("long-one")
        return await task

    out = asyncio.run(aborted())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 4000

    async def aborted_by_prefix() -> list:
        tasks = [asyncio.ensure_future(client.async_generate(input_ids=[5, 6, 7], rid=f"grp::{i}",
                                                             sampling_params={**GREEDY, "max_new_tokens": 4000}))
                 for i in range(2)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(client.abort_request, "grp::", prefix=True)
        return await asyncio.gather(*tasks)

    outs = asyncio.run(aborted_by_prefix())
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert client.flush_cache()
    engine.check_integrity()


def test_release_and_resume_over_http(served, oracle_a):
    client, _ = served
    ok, message = client.release_memory_occupation()
    assert ok, message
    assert sorted(client.get_server_info()["internal_states"][0]["memory_released"]) == \
        ["cuda_graph", "kv_cache", "weights"]
    for tags in (["weights", "cuda_graph"], ["kv_cache"]):
        ok, message = client.resume_memory_occupation(tags)
        assert ok, message
    assert greedy_ids(client) == greedy_ids(oracle_a)
    ok, message = client.release_memory_occupation(["bogus"])
    assert not ok and "bogus" in message
    with pytest.raises(ValueError, match="mode"):
        client.pause_generation(mode="sideways")


def test_a_server_that_is_gone_reads_unhealthy_and_calls_raise():
    from engine_client.client import HttpClient
    from engine_client.http_errors import EngineUnreachable

    port = free_port()  # a port nobody listens on
    client = HttpClient(f"http://127.0.0.1:{port}")
    assert not client.health()
    with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}/generate"):
        client.generate(input_ids=[5, 6], sampling_params=GREEDY)
    with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}/generate"):
        asyncio.run(client.async_generate(input_ids=[5, 6], sampling_params=GREEDY))
    client.close()


def test_the_generation_key_generates_and_only_the_admin_key_controls(served, model_a, oracle_a):
    from engine_client.client import HttpClient

    _, engine = served
    with _serving(engine, api_key="gen", admin_api_key="adm") as url:
        rollout_only, admin = HttpClient(url, api_key="gen"), HttpClient(url, api_key="gen", admin_api_key="adm")
        assert greedy_ids(rollout_only) == greedy_ids(admin) == greedy_ids(oracle_a)
        ok, message, _ = rollout_only.update_weights_from_disk(model_a, weight_version="nope")
        assert not ok and "admin api key" in message
        ok, message, _ = admin.update_weights_from_disk(model_a, weight_version="default")
        assert ok, message
        with pytest.raises(RuntimeError, match="401"):
            rollout_only.pause_generation()
        anonymous = HttpClient(url)
        assert anonymous.health()  # /health is open
        with pytest.raises(RuntimeError, match="401"):
            anonymous.generate(input_ids=[5, 6], sampling_params=GREEDY)
        for client in (rollout_only, admin, anonymous):
            client.close()


def test_weight_session_and_model_info_over_http(served):
    client, engine = served
    assert client.begin_weight_update() == (True, "Success")
    ok, message = client.begin_weight_update("target")
    assert not ok and "already open" in message
    assert client.end_weight_update() == (True, "Success")
    info = client.get_model_info()
    assert info["model_path"] == engine.get_model_info()["model_path"] and info["weight_version"] == client.get_weight_version()
