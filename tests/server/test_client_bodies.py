"""Bodies real SGLang clients send that tandem once refused or answered short: Miles' weight-update
session (/begin_weight_update, /end_weight_update), SGLang's nullable and list `rid` on
/abort_request, SGLang's extra sampling fields and chat_template_kwargs on the OpenAI routes, and
/model_info's model_type and architectures
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
    """A second begin, or an end with none open, is a 400 with success false and SGLang's
    messages (0.5.23); after a refused begin the open session still ends normally."""
    assert client.post("/begin_weight_update", json={"selector": "target"}).json() == {
        "success": True, "message": "Success"}
    again = client.post("/begin_weight_update", json={})
    assert again.status_code == 400 and again.json() == {
        "success": False, "message": "a weight-update session is already open; call end_weight_update() first"}
    assert client.post("/end_weight_update", json={}).status_code == 200
    stray = client.post("/end_weight_update", json={})
    assert stray.status_code == 400 and stray.json() == {
        "success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
    bad = client.post("/begin_weight_update", json={"selector": "both"})
    assert bad.status_code == 400 and "selector" in bad.json()["message"]
    assert client.post("/begin_weight_update", content=b"null").status_code == 400  # not an object
    assert client.post("/end_weight_update").status_code == 400  # none open: a bodiless end is read


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
    assert set(meta["finish_reason"]) == {"type", "message", "status_code", "err_type"}  # SGLang's FINISH_ABORT


def test_model_info_names_the_architecture(client, tiny_model_dir):
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    info = client.get("/model_info").json()
    assert info["model_type"] == config["model_type"] == "qwen3"
    assert info["architectures"] == config["architectures"] == ["Qwen3ForCausalLM"]
    assert info["is_generation"] is True and info["tokenizer_path"] == tiny_model_dir



GREEDY = {"temperature": 0, "ignore_eos": True}


def test_openai_routes_take_sglangs_extra_sampling_fields(client, engine):
    """SGLang's OpenAI routes accept its own sampling fields (the openai package sends them as
    extra_body): they were dropped as unknown, so stop_token_ids did not stop and regex did not
    constrain. Oracle: the same parameters through the in-process API."""
    free = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 6, **GREEDY})["output_ids"]
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "stop_token_ids": [free[1]], "min_tokens": 1, **GREEDY}
    out = client.post("/v1/completions", json=body).json()
    direct = engine.generate(input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 6, "stop_token_ids": [free[1]], "min_new_tokens": 1, **GREEDY})
    assert direct["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[1]}
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["text"] == direct["text"]
    assert out["usage"]["completion_tokens"] == direct["meta_info"]["completion_tokens"] < 6

    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "regex": "[a-z]+",
                                                     "temperature": 0}).json()
    text = chat["choices"][0]["message"]["content"]
    assert text and set(text) <= set("abcdefghijklmnopqrstuvwxyz"), text
    from engine.tokenizer import apply_chat_template

    ids = apply_chat_template(engine.tokenizer, messages)
    assert text == engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "regex": "[a-z]+",
                                                                   "temperature": 0})["text"]
    both = client.post("/v1/chat/completions", json={"messages": messages, "regex": "[a-z]+",
                                                     "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "at most one" in both.json()["message"]


def test_chat_template_kwargs_reach_the_template(engine_factory):
    """Qwen3 users send chat_template_kwargs={"enable_thinking": false}; the template sees it."""
    from engine.tokenizer import apply_chat_template

    eng = engine_factory()
    eng.tokenizer.chat_template += ("{%- if enable_thinking is defined and not enable_thinking %}"
                                    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(create_app(eng)) as c:
        plain = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        off = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert plain["usage"]["prompt_tokens"] == len(apply_chat_template(eng.tokenizer, messages))
        assert off["usage"]["prompt_tokens"] == len(apply_chat_template(eng.tokenizer, messages,
                                                                        enable_thinking=False))
        assert off["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        reserved = c.post("/v1/chat/completions", json={"messages": messages,
                                                        "chat_template_kwargs": {"tokenize": True}})
        assert reserved.status_code == 400 and "tokenize" in reserved.json()["message"]


def test_post_process_weights_around_a_sync(engine):
    """slime's / Miles' patched SGLang route, called around a weight sync: a no-op success here (no
    quantized forms), behind the admin key, with a malformed body still a 400."""
    with TestClient(create_app(engine, admin_api_key="adm")) as c:
        admin = {"Authorization": "Bearer adm"}
        for body in ({"restore_weights_before_load": True, "post_process_quantization": False},
                     {"post_process_quantization": True}, {}, None):
            resp = c.post("/post_process_weights", json=body, headers=admin)
            assert resp.status_code == 200 and resp.json()["success"] is True, (body, resp.text)
        assert c.post("/post_process_weights", json={}).status_code == 401
        bad = c.post("/post_process_weights", json={"restore_weights_before_load": "maybe"}, headers=admin)
        assert bad.status_code == 400 and "restore_weights_before_load" in bad.text
        assert _greedy(c) == _greedy(c)  # still serving


def test_hidden_states_and_custom_logit_processors_are_refused_not_ignored(client):
    """SGLang 400s both unless started for them; tandem has neither, so a request for them is a 400
    naming the field, and their false / null forms (what clients send by default) are fine."""
    base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    for field, value in (("return_hidden_states", True), ("return_hidden_states", [False, True]),
                         ("custom_logit_processor", "serialized"), ("custom_logit_processor", [None, "x"])):
        body = {**base, "input_ids": [[5, 6, 7], [8, 9]]} if isinstance(value, list) else base
        resp = client.post("/generate", json={**body, field: value})
        assert resp.status_code == 400 and field in resp.json()["message"], (field, resp.text)
    for field, value in (("return_hidden_states", False), ("custom_logit_processor", None)):
        assert client.post("/generate", json={**base, field: value}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        for field, value in (("return_hidden_states", True), ("custom_logit_processor", "serialized")):
            resp = client.post(route, json={**body, field: value})
            assert resp.status_code == 400 and field in resp.text, (route, field, resp.text)
        assert client.post(route, json={**body, "return_hidden_states": False}).status_code == 200


def test_abort_request_by_rid_prefix(client, engine):
    """Miles aborts a LoRA adapter's requests with {"rid": "<adapter>::", "prefix": true}; without
    prefix the same rid names no request."""
    outs: dict[str, list] = {rid: [] for rid in ("lora-a::1", "lora-a::2", "lora-b::1")}
    threads = [_long_request(engine, rid, out) for rid, out in outs.items()]
    deadline = time.monotonic() + 20
    while engine.get_stats().num_running_reqs < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.post("/abort_request", json={"rid": "lora-a::"}).status_code == 200
    time.sleep(0.1)
    assert engine.get_stats().num_running_reqs == 3
    assert client.post("/abort_request", json={"rid": "lora-a::", "prefix": True}).status_code == 200
    for thread in threads[:2]:
        thread.join(30)
    assert all(outs[r][0]["meta_info"]["finish_reason"]["type"] == "abort" for r in ("lora-a::1", "lora-a::2"))
    assert not outs["lora-b::1"] and engine.get_stats().num_running_reqs == 1
    client.post("/abort_request", json={"rid": "lora-b::1"})
    threads[2].join(30)
    assert outs["lora-b::1"][0]["meta_info"]["finish_reason"]["type"] == "abort"
