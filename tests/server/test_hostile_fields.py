"""Hostile values in the fields around a prompt (found by a sweep of the server): a weight version,
rid or grammar that is no Unicode text, chat_template_kwargs named like the renderer's own
arguments, /tokenize's text, a corrupt adapter file. Each is a 400 naming the field, nothing is
changed by it, and the engine serves after it. Also: /abort_request with the rid a client sent
for n samples or a batch ends all of them, as SGLang's prefix match does."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from engine.server.http import create_app

GEN = {"max_new_tokens": 2, "temperature": 0.0}
CHAT = [{"role": "user", "content": "hi"}]


def _serving(client) -> None:
    resp = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN})
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 2
    for path in ("/get_server_info", "/get_weight_version", "/metrics"):
        assert client.get(path).status_code == 200, path


@pytest.mark.parametrize("path,body,field", [
    ("/update_weight_version", b'{"new_version": "\\ud800"}', "new_version"),
    ("/generate", b'{"input_ids": [5], "rid": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', "rid"),
    ("/generate", b'{"input_ids": [[5], [6]], "rid": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', "rid"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "regex": "a\\udfff"}}', "regex"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"max_new_tokens": 1, "stop": ["\\ud800"]}}', "stop"),
    ("/tokenize", b'{"prompt": ["a", "\\udfff"]}', "prompt"),
])
def test_text_that_is_no_unicode_is_refused_naming_its_field(raw, path, body, field):
    version = raw.get("/get_weight_version").json()
    resp = raw.post_bytes(path, body)
    assert resp.status_code == 400 and f"{field} is not valid Unicode text" in resp.json()["message"], resp.text
    assert raw.get("/get_weight_version").json() == version  # nothing changed
    _serving(raw)


@pytest.mark.parametrize("version, message", [("v" * 100_000, "at most 256 characters, got 100000"),
                                              ("step\x00 7", "the control character '\\x00'"),
                                              ("step\n7", "the control character '\\n'")])
def test_a_version_too_long_or_with_control_characters_is_refused(raw, version, message):
    """Every reply's meta_info, the metrics' label and the logs carry it."""
    before = raw.get("/get_weight_version").json()
    resp = raw.post("/update_weight_version", json={"new_version": version})
    assert resp.status_code == 400 and message in resp.json()["message"], resp.text
    assert raw.get("/get_weight_version").json() == before
    assert raw.post("/update_weight_version", json={"new_version": "step-7"}).status_code == 200
    # the session's engine is shared: later tests read its version
    assert raw.post("/update_weight_version", json={"new_version": before["weight_version"]}).status_code == 200
    _serving(raw)


def test_disk_update_with_a_bad_version_changes_nothing(raw, tiny_model_dir):
    version = raw.get("/get_weight_version").json()
    resp = raw.post_bytes("/update_weights_from_disk",
                     f'{{"model_path": "{tiny_model_dir}", "weight_version": "\\udfff"}}'.encode())
    assert resp.status_code == 400 and "weight_version is not valid Unicode text" in resp.text
    assert raw.get("/get_weight_version").json() == version
    _serving(raw)


@pytest.mark.parametrize("name", ["tokenizer", "check", "assistant_prefix"])
def test_chat_template_kwargs_cannot_name_the_renderers_arguments(raw, name):
    resp = raw.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {name: 1}})
    assert resp.status_code == 400 and name in resp.json()["message"], resp.text


def test_tokenize_takes_no_more_text_than_generate(raw, engine):
    limit = engine.builder.prompt_size.max_bytes
    resp = raw.post("/tokenize", json={"prompt": "a" * (limit + 1)})
    assert resp.status_code == 400 and "over the limit" in resp.json()["message"]
    assert raw.post("/tokenize", json={"prompt": "hello"}).json()["count"] > 0


def test_a_corrupt_adapter_file_is_a_400(engine_factory, tmp_path):
    import json

    eng = engine_factory(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    with TestClient(create_app(eng), raise_server_exceptions=False) as c:
        resp = c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(folder)})
        assert resp.status_code == 400 and "cannot be read as safetensors" in resp.json()["error_message"], resp.text
        assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN}).status_code == 200


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6], "rid": "grp", "sampling_params": {"n": 3, "max_new_tokens": 3000, "ignore_eos": True}},
    {"input_ids": [[5, 6], [7, 8]], "rid": "grp", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
])
def test_abort_by_the_sent_rid_ends_every_sample(raw, engine, body):
    answers = {}
    worker = threading.Thread(target=lambda: answers.update(resp=raw.post("/generate", json=body)))
    worker.start()
    deadline = time.monotonic() + 30
    while engine.get_stats().num_running_reqs + engine.get_stats().num_waiting_reqs < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raw.post("/abort_request", json={"rid": "grp"}).status_code == 200
    worker.join(timeout=60)
    outs = answers["resp"].json()
    assert len(outs) in (2, 3) and all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(o["meta_info"]["completion_tokens"] < 3000 for o in outs)
    _serving(raw)


@pytest.mark.parametrize("field,value", [("world_size", 1 << 40), ("world_size", 0), ("rank_offset", -1)])
def test_weights_group_sizes_are_checked_before_any_rendezvous(raw, field, value):
    body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2, field: value}
    resp = raw.post("/init_weights_update_group", json=body)
    assert resp.status_code == 400 and field in resp.text, resp.text


def test_get_weights_by_name_returns_at_most_a_bounded_read(raw, engine, monkeypatch):
    from engine.core import weight_queries

    monkeypatch.setattr(weight_queries, "MAX_READ_VALUES", 100)  # the tiny model's tensors are small
    resp = raw.post("/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 10 ** 9})
    assert resp.status_code == 400 and "truncate_size <=" in resp.json()["message"], resp.text
    assert raw.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5}).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [True, False], "sampling_params": GEN}),
    ("/generate", {"input_ids": ["5", 6], "sampling_params": GEN}),
    ("/generate", {"input_ids": [[5, 6.0]], "sampling_params": GEN}),
    ("/v1/completions", {"prompt": [True, 5], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [True]}),
    ("/v1/chat/completions", {"messages": CHAT, "input_ids": ["5"], "max_tokens": 1}),
    ("/detokenize", {"tokens": [True]}),
])
def test_token_ids_are_ints_as_sent(raw, path, body):
    """pydantic's lax mode read true as token 1 and "5" as 5: a careless client's prompt silently
    became other tokens. Token ids must be JSON integers."""
    resp = raw.post(path, json=body)
    assert resp.status_code == 400 and "integer" in resp.text, resp.text
    _serving(raw)


def test_a_request_aborted_before_it_ran_says_so_as_sglang(raw, engine):
    """AReaL (and others) branch on SGLang's "Abort before prefill": no output to read."""
    raw.post("/pause_generation", json={"mode": "in_place"})  # requests sent now wait in the queue
    answers = {}
    try:
        worker = threading.Thread(target=lambda: answers.update(resp=raw.post(
            "/generate", json={"input_ids": [5, 6], "rid": "queued", "sampling_params": GEN})))
        worker.start()
        deadline = time.monotonic() + 30
        while engine.get_stats().num_waiting_reqs < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert raw.post("/abort_request", json={"rid": "queued"}).status_code == 200
        worker.join(timeout=30)
    finally:
        raw.post("/continue_generation")
    reason = answers["resp"].json()["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None}
    _serving(raw)
