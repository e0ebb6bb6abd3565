"""Bodies real SGLang clients send that tandem once refused or answered short: Miles' weight-update
session (/begin_weight_update, /end_weight_update), SGLang's nullable and list `rid` on
/abort_request, a bodiless /pause_generation, and /model_info's model_type and architectures
(shared/reference/sglang-rl-api.md 1.6, 1.9, 1.10, 1.12; Miles sglang_engine.py)."""

from __future__ import annotations

import json
import os
import threading
import time

from fastapi.testclient import TestClient

from engine.server.http import create_app


def _checkpoint(model_dir: str) -> list:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return [kv for path in safetensors_files(model_dir) for kv in load_file(path).items()]


def _greedy(c: TestClient) -> list[int]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    return c.post("/generate", json=body).json()["output_ids"]


def test_miles_weight_sync_session(engine_factory, other_model_dir):
    """Miles' sync: pause retract -> GET /flush_cache -> begin {selector} -> bucket updates carrying
    `selector` -> end {} -> continue; it raises on any non-200 and reads `success`."""
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    eng = engine_factory()
    checkpoint = _checkpoint(other_model_dir)
    with TestClient(create_app(eng)) as c:
        before = _greedy(c)
        assert c.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        assert c.get("/flush_cache").status_code == 200
        begin = c.post("/begin_weight_update", json={"selector": "all", "sync_base": True})
        assert begin.status_code == 200 and begin.json()["success"] is True, begin.text
        payload = serialize(FlattenedBucket.pack(checkpoint).to_payload(), as_text=True)
        update = c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False,
            "selector": "all", "weight_version": "3"})
        assert update.status_code == 200 and update.json()["success"] is True, update.text
        end = c.post("/end_weight_update", json={"expected_lora_checksums": None})
        assert end.status_code == 200 and end.json()["success"] is True, end.text
        assert c.post("/continue_generation", json={}).status_code == 200
        norm = dict(checkpoint)["model.norm.weight"].tolist()
        assert c.post("/get_weights_by_name", json={"name": "model.norm.weight"}).json() == norm
        assert _greedy(c) != before
        assert c.get("/model_info").json()["weight_version"] == "3"


def test_weight_update_session_order_is_checked(client):
    """A second begin, or an end with none open, is a 400 with success false (SGLang 0.5.23);
    after a refused begin the open session still ends normally."""
    assert client.post("/begin_weight_update", json={"selector": "target"}).json()["success"] is True
    again = client.post("/begin_weight_update", json={})
    assert again.status_code == 400 and again.json()["success"] is False
    assert "'target'" in again.json()["message"]
    assert client.post("/end_weight_update", json={}).status_code == 200
    stray = client.post("/end_weight_update", json={})
    assert stray.status_code == 400 and stray.json()["success"] is False
    bad = client.post("/begin_weight_update", json={"selector": "both"})
    assert bad.status_code == 400 and "selector" in bad.json()["message"]
    # no body at all: selector "all"
    assert client.post("/begin_weight_update").json()["success"] is True
    assert client.post("/end_weight_update").json()["success"] is True


def test_session_routes_take_the_admin_key(engine):
    with TestClient(create_app(engine, api_key="gen", admin_api_key="adm")) as c:
        for path in ("/begin_weight_update", "/end_weight_update"):
            assert c.post(path, json={}, headers={"Authorization": "Bearer gen"}).status_code == 401
        ok = c.post("/begin_weight_update", json={}, headers={"Authorization": "Bearer adm"})
        assert ok.status_code == 200 and ok.json()["success"] is True
        assert c.post("/end_weight_update", json={}, headers={"Authorization": "Bearer adm"}).json()["success"]


def _long_request(engine, rid: str, out: list) -> threading.Thread:
    body = {"max_new_tokens": 3000, "ignore_eos": True}
    thread = threading.Thread(target=lambda: out.append(engine.generate(input_ids=[5, 6, 7], rid=rid,
                                                                        sampling_params=body)))
    thread.start()
    deadline = time.monotonic() + 20
    while engine.get_stats().num_running_reqs < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread


def test_abort_request_rid_null_and_list(client, engine):
    """SGLang's AbortReq takes rid null (aborts nothing) and, through BaseReq, a list of rids."""
    out: list = []
    thread = _long_request(engine, "abort-list-1", out)
    nothing = client.post("/abort_request", json={"rid": None, "abort_all": False, "abort_message": None})
    assert nothing.status_code == 200 and nothing.content == b""
    time.sleep(0.05)
    assert engine.get_stats().num_running_reqs == 1 and not out  # still running
    resp = client.post("/abort_request", json={"rid": ["no-such-rid", "abort-list-1"]})
    assert resp.status_code == 200
    thread.join(30)
    meta = out[0]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 3000


def test_pause_and_continue_without_a_body(client):
    """`curl -X POST /pause_generation` (no JSON at all) pauses in SGLang's default mode, abort."""
    resp = client.post("/pause_generation")
    assert resp.status_code == 200 and resp.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert client.get("/get_server_info").json()["internal_states"][0]["paused"] is True
    assert client.post("/continue_generation").status_code == 200
    assert client.get("/get_server_info").json()["internal_states"][0]["paused"] is False


def test_model_info_names_the_architecture(client, tiny_model_dir):
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    info = client.get("/model_info").json()
    assert info["model_type"] == config["model_type"] == "qwen3"
    assert info["architectures"] == config["architectures"] == ["Qwen3ForCausalLM"]
    assert info["is_generation"] is True and info["tokenizer_path"] == tiny_model_dir

