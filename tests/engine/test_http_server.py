"""The HTTP server over a real engine on the tiny model (FastAPI TestClient, no sockets)."""

from __future__ import annotations

import base64
import json

import pytest

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from engine.server.http import create_app  # noqa: E402
from engine.models.parallel_state import free_port

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


def test_generate_matches_in_process_api(client, engine):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "return_logprob": True}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200
    out = resp.json()
    direct = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == direct["output_ids"]
    # the second run reads its prefix from the cache: equal up to float error (bitwise only in
    # deterministic mode)
    assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in direct["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_generate_stream_is_sse(client):
    body = {"text": "Hello", "sampling_params": GREEDY, "stream": True}
    with client.stream("POST", "/generate", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    # a chunk per token, unless the reader lags (a busy host): then only the newest is sent (SGLang)
    tokens = [len(c["output_ids"]) for c in chunks]
    assert 2 <= len(chunks) <= 6 and tokens == sorted(set(tokens)) and tokens[-1] == 6, tokens
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_completion_and_chat(client):
    resp = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200
    assert chat.json()["usage"]["completion_tokens"] == 4
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 3, "stream": True, "ignore_eos": True}) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    # role, 3 tokens, the finish: 4 events before [DONE] when the reader keeps up; fewer when it lags
    assert lines[-1] == "data: [DONE]" and 3 <= len(lines) <= 5, lines
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 7}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"unknown": 1}}, "unknown"),  # top-level ones are ignored
    ({"text": ["hi", "yo"], "input_ids": [1]}, "disagree"),
    ({"input_ids": [1, 2], "priority": "high"}, "priority"),
    ({"input_ids": [1, 2], "priority": 2**63}, "priority"),
])
def test_bad_requests_get_400_and_server_keeps_serving(client, body, needle):
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400 and needle in resp.json()["message"]
    assert client.post("/generate", json={"input_ids": [3], "sampling_params": GREEDY}).status_code == 200


def test_text_beside_input_ids_rides_along_and_priority_is_ignored(client):
    """SGLang's rules: with both, input_ids is the prompt; priority without priority scheduling
    is taken and ignored (slime-style clients send either)."""
    body = {"input_ids": [3, 4, 5], "sampling_params": GREEDY, "return_prompt_token_ids": True}
    alone = client.post("/generate", json=body).json()
    both = client.post("/generate", json=dict(body, text="anything at all", priority=7)).json()
    assert both["prompt_token_ids"] == [3, 4, 5] and both["output_ids"] == alone["output_ids"]
    batch = client.post("/generate", json={"text": ["a", "b"], "input_ids": [[3, 4], [5]], "sampling_params": GREEDY})
    assert batch.status_code == 200 and [r["meta_info"]["prompt_tokens"] for r in batch.json()] == [2, 1]


def test_malformed_json_is_400(client):
    resp = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400


def test_metrics_health_and_flush(client):
    assert client.get("/health").status_code == 200
    text = client.get("/metrics").text
    assert "tandem_generation_tokens" in text and "tandem_retractions" in text
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/model_info").json()["weight_version"] == "default"


def test_api_key_guards_routes(engine):
    with TestClient(create_app(engine, api_key="s3cret")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/flush_cache").status_code == 401
        ok = c.post("/flush_cache", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 401
        assert not engine.local_core.paused


def test_rl_control_routes(engine_factory, other_model_dir, tmp_path):
    eng = engine_factory()  # its own engine: these routes change its weights
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    with TestClient(create_app(eng)) as c:
        before = c.post("/generate", json=body).json()["output_ids"]
        paused = c.post("/pause_generation", json={"mode": "retract"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert eng.local_core.paused
        bad = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and bad.json()["success"] is False and "none" in bad.json()["message"]
        good = c.post("/update_weights_from_disk", json={"model_path": other_model_dir, "weight_version": "s1"})
        assert good.status_code == 200, good.json()
        assert good.json() == {"success": True, "message": "Succeeded to update model weights.",  # SGLang's
                               "num_paused_requests": 0}
        resumed = c.post("/continue_generation")
        assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
        after = c.post("/generate", json=body).json()
        assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "s1"
        text = c.get("/metrics").text
        assert "tandem_weight_updates_total 1.0" in text and 'tandem_weight_version{version="s1"} 1.0' in text
        version = c.post("/update_weight_version", json={"new_version": "s2"})
        assert version.json() == {"success": True, "message": "Weight version updated to s2", "new_version": "s2"}
        assert c.get("/model_info").json()["weight_version"] == "s2"
        wrong = c.post("/pause_generation", json={"mode": "later"})
        assert wrong.status_code == 400 and "mode" in wrong.json()["message"]
        assert not eng.local_core.paused
    eng.check_integrity()


def test_update_weights_from_tensor_route(engine_factory, other_model_dir):
    import pickle

    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    eng = engine_factory()
    named = [kv for path in safetensors_files(other_model_dir) for kv in load_file(path).items()]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    with TestClient(create_app(eng)) as c:
        before = c.post("/generate", json=body).json()["output_ids"]
        evil = base64.b64encode(pickle.dumps(eval)).decode()
        refused = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
        assert refused.status_code == 400 and "names builtins.eval" in refused.json()["message"]
        assert c.post("/generate", json=body).json()["output_ids"] == before
        bucket = serialize(FlattenedBucket.pack(named).to_payload(), as_text=True)
        resp = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [bucket],
                                                          "load_format": "flattened_bucket",
                                                          "weight_version": "ipc-1"})
        assert resp.status_code == 200 and resp.json() == {"success": True,
                                                           "message": "Success. Weight version updated to ipc-1."}
        after = c.post("/generate", json=body).json()
        assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "ipc-1"
        plain = serialize(named, as_text=True)  # [(name, tensor)] without a bucket
        assert c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [plain]}).status_code == 200
    eng.check_integrity()


def test_distributed_update_routes_name_bad_arguments(engine_factory):
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        bad = c.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1,
                                                          "rank_offset": 1, "world_size": 2, "backend": "mpi"})
        assert bad.status_code == 400 and "backend must be one of nccl, gloo" in bad.json()["message"]
        body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
        missing = c.post("/update_weights_from_distributed", json=body)
        assert missing.status_code == 400 and "init_weights_update_group first" in missing.json()["message"]
        wrong = c.post("/update_weights_from_distributed", json={**body, "shapes": "64"})
        assert wrong.status_code == 400 and "shapes" in wrong.json()["message"]


def test_init_weights_update_group_honours_the_body_timeout(engine_factory):
    """A rendezvous with nobody at the address answers within the body's timeout_s."""
    import time

    port = free_port()  # a local port nobody listens on
    eng = engine_factory()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "nobody", "backend": "gloo"}
    with TestClient(create_app(eng)) as c:
        start = time.monotonic()
        resp = c.post("/init_weights_update_group", json={**body, "timeout_s": 1})
        assert resp.status_code == 400 and "nobody" in resp.json()["message"]
        assert time.monotonic() - start < 4.0
        assert c.post("/init_weights_update_group", json={**body, "timeout_s": -1}).status_code == 400


def test_update_with_abort_all_requests_ends_them_and_flushes(engine_factory, other_model_dir):
    import threading
    import time

    eng = engine_factory()
    long = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(out=eng.generate(input_ids=[5, 6, 7], sampling_params=long)))
    runner.start()
    while not eng.local_core.scheduler.running:  # decoding, not paused
        time.sleep(0.01)
    with TestClient(create_app(eng)) as c:
        resp = c.post("/update_weights_from_disk", json={"model_path": other_model_dir, "abort_all_requests": True})
    runner.join(timeout=30)
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.json()  # flushed: nothing runs
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    eng.check_integrity()


def _samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_carry_sglangs_names_for_its_dashboards(client, engine):
    """Miles' dashboard (and SGLang's Grafana boards) read sglang:* families; the values are the
    snapshot's, as tandem's own families report them."""
    before = _samples(client.get("/metrics").text)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    for _ in range(2):  # the second prefill hits the radix cache
        client.post("/generate", json={"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    after = _samples(client.get("/metrics").text)
    # every completion token, as SGLang counts them (each request's first one comes from its prefill)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 2 * 4
    assert after["sglang:generation_tokens_total"] == after["tandem_generation_tokens_total"]
    assert after["sglang:prompt_tokens_total"] == after["tandem_prompt_tokens_total"] + after["tandem_cached_tokens_total"]
    assert after["sglang:cached_tokens_total"] > before.get("sglang:cached_tokens_total", 0)
    assert 0 < after["sglang:cache_hit_rate"] < 1
    assert after["sglang:token_usage"] == after["tandem_kv_token_usage"]
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput", "sglang:num_used_tokens"):
        assert name in after


def test_gen_throughput_is_the_rate_between_scrapes():
    from types import SimpleNamespace

    from engine.server.metrics import GenThroughput

    meter = GenThroughput()
    at = lambda t, n: SimpleNamespace(uptime_s=t, num_generated_tokens=n)  # noqa: E731
    assert meter.update(at(10.0, 100)) == 0.0  # the first scrape: no interval yet
    assert meter.update(at(10.5, 400)) == 0.0  # too soon: the last rate stands
    assert meter.update(at(12.0, 700)) == 300.0
    assert meter.update(at(14.0, 700)) == 0.0  # idle
    assert meter.update(at(15.0, 50)) == 0.0  # counters went back (a new core): start again
    assert meter.update(at(17.0, 250)) == 100.0
    assert meter.update(at(3.0, 900)) == 100.0  # a new core, younger but with more tokens: start again
    assert meter.update(at(5.0, 1100)) == 100.0


def test_chunked_prefill_counts_only_the_radix_caches_prefix_as_cached(engine_factory):
    """A later chunk's prefix is the request's own earlier chunks, not a cache hit (it inflated
    cached_tokens and the cache hit rate dashboards read)."""
    eng = engine_factory(chunked_prefill_size=16)
    prompt = list(range(3, 67))  # 64 tokens: four chunks
    base = eng.get_stats()
    eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
    cold = eng.get_stats()
    assert cold.num_prefill_tokens - base.num_prefill_tokens == 64
    assert cold.num_cached_tokens - base.num_cached_tokens == 0
    again = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1})
    warm = eng.get_stats()
    hit = again["meta_info"]["cached_tokens"]
    assert hit > 0 and warm.num_cached_tokens - cold.num_cached_tokens == hit
    assert warm.num_prefill_tokens - cold.num_prefill_tokens == 64 - hit
