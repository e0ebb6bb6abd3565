"""The OpenAI layer, with the shapes the `openai` package sends and reads (SGLang's
test_openai_server.py): logprobs, top_logprobs, echo, usage, stream_options, metadata."""

from __future__ import annotations

import json

import pytest

GREEDY = {"temperature": 0, "ignore_eos": True}


def sse(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completion_logprobs_are_the_engine_logprobs(client, engine):
    body = {"model": "x", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 3, **GREEDY}
    out = client.post("/v1/completions", json=body).json()
    direct = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, **GREEDY},
                             return_logprob=True, top_logprobs_num=3)
    lp = out["choices"][0]["logprobs"]
    tok = engine.tokenizer
    expected = direct["meta_info"]["output_token_logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for _, t, _ in expected]
    assert lp["token_logprobs"] == pytest.approx([v for v, _, _ in expected], abs=1e-5)
    assert all(0 < len(top) <= 3 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert out["metadata"]["weight_version"] == "default"


def test_completion_echo_prepends_prompt_and_its_logprobs(client, engine):
    text = "Hello world"
    out = client.post("/v1/completions", json={"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 1,
                                               **GREEDY}).json()
    choice = out["choices"][0]
    plain = client.post("/v1/completions", json={"prompt": text, "max_tokens": 3, **GREEDY}).json()
    assert choice["text"] == text + plain["choices"][0]["text"]
    n_prompt = out["usage"]["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None  # the first prompt token has none
    assert len(choice["logprobs"]["tokens"]) == n_prompt + 3
    assert "".join(choice["logprobs"]["tokens"][:n_prompt]) == text


@pytest.mark.parametrize("echo, max_tokens", [(True, 4), (True, 0), (False, 4)])
def test_streamed_completion_logprobs_join_to_the_whole_replys(client, engine, echo, max_tokens):
    """Streamed, the chunks' logprobs put together are the reply's: with echo the first carries the
    prompt's entries, and every text_offset counts from the start of the choice's text (a
    streamed echo had only the generated tokens, each chunk's offsets from 0)."""
    body = {"prompt": "The cat sat", "max_tokens": max_tokens, "echo": echo, "logprobs": 1, **GREEDY}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [c["choices"][0] for c in sse(client, "/v1/completions", {**body, "stream": True}) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key], key
    joined = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert joined[:1] == whole["logprobs"]["token_logprobs"][:1]  # None for an echoed first token
    assert joined[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_streamed_text_offsets_run_over_the_tokens_texts(engine, monkeypatch):
    """text_offset adds up each token's decoded text, as the whole reply counts it, also where that
    text is not the token's share of the reply (a BOS's "<s>", sentencepiece's dropped space)."""
    from fastapi.testclient import TestClient

    from engine.server import openai as openai_mod
    from engine.server.http import create_app

    real = openai_mod.token_decoder
    monkeypatch.setattr(openai_mod, "token_decoder", lambda tok: (lambda ids, _d=real(tok): "<" + _d(ids) + ">"))
    with TestClient(create_app(engine)) as c:
        for echo in (True, False):
            body = {"prompt": "The cat sat", "max_tokens": 4, "echo": echo, "logprobs": 1, **GREEDY}
            whole = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
            chunks = [ch["choices"][0] for ch in sse(c, "/v1/completions", {**body, "stream": True}) if ch["choices"]]
            assert [v for ch in chunks for v in ch["logprobs"]["text_offset"]] == whole["text_offset"], echo


def test_usage_counts_each_prompt_once_with_n(client, engine):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = client.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 2, **GREEDY}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}


def test_stream_include_usage_gives_a_final_usage_chunk(client):
    body = {"prompt": ["Hi", "Hello there"], "max_tokens": 3, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}, **GREEDY}
    chunks = sse(client, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    finished = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]
    without = sse(client, "/v1/completions", {**body, "stream_options": None})
    assert all("usage" not in c for c in without)


def test_chat_logprobs_and_top_logprobs(client, engine):
    body = {"model": "x", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **GREEDY}
    out = client.post("/v1/chat/completions", json=body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 == out["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the top token
    assert "".join(e["token"] for e in content) == out["choices"][0]["message"]["content"]
    assert out["metadata"]["weight_version"] == "default" and out["metadata"]["weight_versions"][0]["end"] == 3
    assert out["choices"][0]["logprobs"] is not None
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": False}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_stream_role_once_per_choice_and_one_finish_each(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "stream": True, **GREEDY}
    chunks = sse(client, "/v1/chat/completions", body)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and all("role" not in m["delta"] for m in mine[1:])
        assert sum(m["finish_reason"] is not None for m in mine) == 1


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "top_p": 7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 7}),
    ("/v1/completions", {"prompt": "Hi", "n": 0}),
    ("/generate", {"text": "Hi", "sampling_params": {"top_p": 7}}),
])
def test_bad_streamed_request_is_400_before_streaming(client, engine, path, body):
    resp = client.post(path, json={**body, "stream": True})
    assert resp.status_code == 400 and resp.json()["object"] == "error"
    assert engine.get_stats().num_waiting_reqs == 0 and engine.get_stats().num_running_reqs == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_a_reply_id_is_its_rid_which_aborts_it(client, path, body):
    """SGLang's reply id is the request's rid (meta_info["id"]): a client aborts a stream by it."""
    named = client.post(path, json={**body, "max_tokens": 2, "rid": "my-rid", **GREEDY}).json()
    assert named["id"] == "my-rid"
    unnamed = client.post(path, json={**body, "max_tokens": 2, **GREEDY}).json()
    assert unnamed["id"] and unnamed["id"] != "my-rid"
    with client.stream("POST", path, json={**body, "max_tokens": 3000, "stream": True, **GREEDY}) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert client.post("/abort_request", json={"rid": first["id"]}).status_code == 200
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert {e["id"] for e in events} == {first["id"]}
    assert events[-1]["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_custom_params_reach_the_sampling_params(client, path, body):
    """As SGLang's to_sampling_params: checked there, so slime's top-p replay without a top-p is
    refused here too (tests/engine/test_top_p_replay.py: with one)."""
    assert client.post(path, json={**body, "max_tokens": 1, "custom_params": {"a": 1}}).status_code == 200
    refused = client.post(path, json={**body, "max_tokens": 1, "custom_params": {"return_top_p_token_ids": True}})
    assert refused.status_code == 400 and "return_top_p_token_ids" in refused.json()["message"]
    wrong = client.post(path, json={**body, "max_tokens": 1, "custom_params": [1]})
    assert wrong.status_code == 400 and "custom_params" in wrong.json()["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_answer_with_stop_strings_joins_to_the_unstreamed_one(client, engine, path):
    """Every stop string made of the greedy text's own characters (two to four of them, from each
    position): the deltas of a stream join to exactly the text the same body answers unstreamed
    (the start of a stop string is held back, never sent and then trimmed)."""
    body = {"max_tokens": 24, **GREEDY}
    body.update({"prompt": "The quick brown fox"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "The quick brown fox"}]})
    free = client.post(path, json=body).json()["choices"][0]
    text = free["text"] if "chat" not in path else free["message"]["content"]
    stops = sorted({text[i:i + n] for n in (2, 3, 4) for i in range(0, len(text) - n, 3)} - {""})[:12]
    assert stops, text
    for stop in stops:
        whole = client.post(path, json={**body, "stop": [stop]}).json()["choices"][0]
        events = sse(client, path, {**body, "stop": [stop], "stream": True})
        if "chat" in path:
            want = whole["message"]["content"] or ""
            got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        else:
            want, got = whole["text"], "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert got == want, (stop, got, want)
