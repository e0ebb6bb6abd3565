"""Bodies real SGLang clients send that tandem once ignored silently or refused without need:
multimodal inputs, embeddings, session_params and return_entropy on /generate (verl and slime
send image_data), stop_regex and response_format structural_tag on the OpenAI routes (SGLang maps
both), return_routed_experts there (SGLang's sglext.routed_experts), and OpenAI's completion
suffix and best_of (io_struct.py GenerateReqInput; entrypoints/openai/protocol.py)."""

from __future__ import annotations

import json

import pytest

GEN = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi there"}]
CONST = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello world"}}


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _refused(resp, field: str) -> None:
    assert resp.status_code == 400, resp.text
    assert f"{field} is not supported" in resp.json()["message"], resp.text


@pytest.mark.parametrize("field, value", [
    ("image_data", ["http://x/a.png"]), ("image_data", [None, "data:image/png;base64,AAAA"]),
    ("video_data", "v.mp4"), ("audio_data", ["a.wav"]), ("session_params", {"id": "s1", "offset": 0}),
    ("return_entropy", True)])
def test_generate_refuses_fields_it_cannot_serve(client, field, value):
    _refused(client.post("/generate", json={"text": ["hi", "yo"], "sampling_params": GEN, field: value}), field)


def test_generate_names_input_embeds_not_a_missing_prompt(client):
    _refused(client.post("/generate", json={"input_embeds": [[0.1, 0.2]], "sampling_params": GEN}), "input_embeds")


def test_empty_values_of_refused_fields_ask_for_nothing(client):
    plain = _ok(client.post("/generate", json={"text": ["hi", "yo"], "sampling_params": GEN}))
    empty = _ok(client.post("/generate", json={"text": ["hi", "yo"], "sampling_params": GEN, "image_data": [None, []],
                                               "session_params": {}, "return_entropy": False, "audio_data": None}))
    assert [o["output_ids"] for o in empty] == [o["output_ids"] for o in plain]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})])
def test_openai_routes_refuse_session_params(client, path, body):
    _refused(client.post(path, json={**body, "max_tokens": 2, "session_params": {"id": "s1"}}), "session_params")


def test_completions_stop_regex_stops_as_generate_does(client):
    params = {"max_new_tokens": 8, "temperature": 0, "stop_regex": ["[a-z]"]}
    gen = _ok(client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params}))
    assert gen["meta_info"]["finish_reason"]["type"] == "stop", gen
    out = _ok(client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                                                   "stop_regex": ["[a-z]"]}))
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (gen["text"], "stop")
    assert out["usage"]["completion_tokens"] == gen["meta_info"]["completion_tokens"] < 8
    unstopped = _ok(client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}))
    assert unstopped["usage"]["completion_tokens"] == 8


def test_chat_stop_regex_stops_as_generate_does(client):
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "return_prompt_token_ids": True}
    chat = _ok(client.post("/v1/chat/completions", json={**body, "stop_regex": "[a-z]"}))["choices"][0]
    gen = _ok(client.post("/generate", json={"input_ids": chat["prompt_token_ids"], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop_regex": "[a-z]"}}))
    assert gen["meta_info"]["finish_reason"]["type"] == "stop", gen
    assert (chat["message"]["content"], chat["finish_reason"]) == (gen["text"], "stop")


@pytest.mark.parametrize("path, body, text", [
    ("/v1/completions", {"prompt": "hi"}, lambda c: c["text"]),
    ("/v1/chat/completions", {"messages": CHAT}, lambda c: c["message"]["content"])])
def test_response_format_structural_tag_constrains_the_output(client, path, body, text):
    out = _ok(client.post(path, json={**body, "max_tokens": 20, "temperature": 0, "response_format": CONST}))
    assert (text(out["choices"][0]), out["choices"][0]["finish_reason"]) == ("hello world", "stop")


def test_legacy_structural_tag_format_is_taken(client):
    legacy = {"type": "structural_tag", "triggers": ["<f>"],
              "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}
    out = _ok(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "response_format": legacy}))
    assert out["usage"]["completion_tokens"] >= 1


def test_completion_suffix_and_best_of(client):
    base = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    _refused(client.post("/v1/completions", json={**base, "suffix": "END"}), "suffix")
    _refused(client.post("/v1/completions", json={**base, "n": 2, "best_of": 3}), "best_of=3")
    plain = _ok(client.post("/v1/completions", json=base))["choices"]
    for harmless in ({"suffix": ""}, {"best_of": 1}, {"n": 2, "best_of": 2}):
        choices = _ok(client.post("/v1/completions", json={**base, **harmless}))["choices"]
        assert [c["text"] for c in choices] == [plain[0]["text"]] * len(choices)


def test_hidden_states_last_is_refused_as_unsupported(client):
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "return_hidden_states": "last"})
    _refused(resp, "return_hidden_states")


def test_routed_experts_need_the_flag_on_openai_routes(client):
    resp = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "return_routed_experts": True})
    assert resp.status_code == 400 and "--enable-return-routed-experts" in resp.json()["message"], resp.text


@pytest.fixture(scope="module")
def moe_client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from engine import Engine
    from engine.server.http import create_app
    from engine.testing.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-moe"), preset="tiny-moe", seed=0)
    eng = Engine(model_path=str(model), dtype="float32", device="cpu", enable_return_routed_experts=True)
    try:
        with TestClient(create_app(eng)) as c:
            yield c
    finally:
        eng.shutdown()


def test_routed_experts_come_back_as_sglext(moe_client):
    gen = _ok(moe_client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GEN,
                                                 "return_routed_experts": True}))
    routes = gen["meta_info"]["routed_experts"]
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = _ok(moe_client.post("/v1/completions", json={**body, "return_routed_experts": True}))
    assert out["sglext"] == {"routed_experts": routes}
    assert "sglext" not in _ok(moe_client.post("/v1/completions", json=body))
    stream = moe_client.post("/v1/completions", json={**body, "return_routed_experts": True, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    ext, usage = events[-2], events[-1]  # SGLang's order: the sglext chunk, then the usage chunk
    assert (ext["choices"], ext["sglext"]) == ([], {"routed_experts": routes})
    assert usage["usage"]["completion_tokens"] == 3
    chat = _ok(moe_client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                             "return_routed_experts": True}))
    assert isinstance(chat["sglext"]["routed_experts"], str) and chat["sglext"]["routed_experts"]


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": [5, 6, 7]}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats_put_usage_on_every_chunk(client, path, body):
    resp = client.post(path, json={**body, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
                                   "stream_options": {"continuous_usage_stats": True}})
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert events and all(e["choices"] for e in events)  # no include_usage: no usage-only chunk
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 3, counts
    assert {e["usage"]["total_tokens"] - e["usage"]["completion_tokens"] for e in events} == {
        events[0]["usage"]["prompt_tokens"]}
