"""Bodies agent frameworks send to SGLang's chat route, and what they read back: a turn without
max_tokens runs to the context length (SGLang's None), Miles' sessions send the prompt's ids
(`input_ids`: the template skipped) and read `choices[0].meta_info` (`return_meta_info`), and
SGLang's `return_prompt_token_ids` / `return_token_ids`. /generate's explicit null max_new_tokens
is SGLang's "no limit of its own" too. Oracle: the in-process engine on the same ids."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.server.http import create_app
from engine.tokenizer import apply_chat_template

CONTEXT = 96
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(engine_factory):
    eng = engine_factory(context_length=CONTEXT)
    with TestClient(create_app(eng)) as c:
        yield c, eng


def test_chat_without_max_tokens_runs_to_the_context_length(served):
    c, eng = served
    prompt = len(apply_chat_template(eng.tokenizer, USER))
    for unset in ({}, {"max_tokens": None, "max_completion_tokens": None}):
        resp = c.post("/v1/chat/completions", json={"messages": USER, **unset, **GREEDY})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == CONTEXT - prompt and body["choices"][0]["finish_reason"] == "length"
    capped = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5, **GREEDY}).json()
    assert capped["usage"]["completion_tokens"] == 5
    completion = c.post("/v1/completions", json={"prompt": [5, 6, 7], **GREEDY}).json()
    assert completion["usage"]["completion_tokens"] == 16  # the completions route keeps OpenAI's default


def test_generate_null_max_new_tokens_is_no_limit_but_missing_is_128(engine_factory):
    eng = engine_factory(context_length=200)
    with TestClient(create_app(eng)) as c:
        null = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": None, **GREEDY}})
        assert null.status_code == 200, null.text
        assert len(null.json()["output_ids"]) == 197
        missing = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**GREEDY, "stop": None}})
        assert len(missing.json()["output_ids"]) == 128
        too_many = c.post("/generate", json={"input_ids": [5, 6, 7],
                                             "sampling_params": {"max_new_tokens": None, "min_new_tokens": 500}})
        assert too_many.status_code == 400 and "min_new_tokens 500" in too_many.json()["message"]
        assert c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_input_ids_skip_the_template_and_meta_info_comes_back(served):
    """Miles' session turn: its own prompt ids, logprobs, return_meta_info; it reads
    meta_info.output_token_logprobs ([logprob, id, text]) and meta_info.completion_tokens."""
    c, eng = served
    ids = [5, 6, 7, 8, 9]
    body = {"messages": USER, "input_ids": ids, "max_tokens": 4, "logprobs": True, "return_meta_info": True,
            "no_stop_trim": False, **GREEDY}
    resp = c.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice, usage = resp.json()["choices"][0], resp.json()["usage"]
    ref = eng.generate(input_ids=ids, return_logprob=True, sampling_params={"max_new_tokens": 4, **GREEDY})
    assert usage["prompt_tokens"] == len(ids)
    meta = choice["meta_info"]
    assert meta["completion_tokens"] == 4 and [e[1] for e in meta["output_token_logprobs"]] == ref["output_ids"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert all(e[2] == eng.tokenizer.decode([e[1]]) for e in meta["output_token_logprobs"])  # texts, as SGLang's chat
    assert "prompt_token_ids" not in choice and "token_ids" not in choice


def test_prompt_and_output_token_ids(served):
    c, eng = served
    rendered = apply_chat_template(eng.tokenizer, USER)
    body = {"messages": USER, "max_tokens": 3, **GREEDY}
    plain = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "meta_info" not in plain and "prompt_token_ids" not in plain
    prompt_only = c.post("/v1/chat/completions", json={**body, "return_prompt_token_ids": True}).json()["choices"][0]
    assert prompt_only["prompt_token_ids"] == rendered and "token_ids" not in prompt_only
    both = c.post("/v1/chat/completions", json={**body, "return_token_ids": True, "n": 2}).json()["choices"]
    ref = eng.generate(input_ids=rendered, sampling_params={"max_new_tokens": 3, **GREEDY})["output_ids"]
    assert [ch["token_ids"] for ch in both] == [ref, ref] and all(ch["prompt_token_ids"] == rendered for ch in both)


@pytest.mark.parametrize("field", ["return_meta_info", "return_prompt_token_ids", "return_token_ids"])
def test_token_outputs_are_refused_when_streaming(served, field):
    c, _ = served
    resp = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True, field: True})
    assert resp.status_code == 400 and field in resp.json()["message"] and "stream" in resp.json()["message"]


def test_input_ids_are_checked_like_a_prompts(served):
    c, eng = served
    vocab = eng.info.vocab_size
    bad = c.post("/v1/chat/completions", json={"messages": USER, "input_ids": [5, vocab], "max_tokens": 2})
    assert bad.status_code == 400 and str(vocab) in bad.json()["message"]
    long = c.post("/v1/chat/completions", json={"messages": USER, "input_ids": [5] * CONTEXT, "max_tokens": 2})
    assert long.status_code == 400 and "context length" in long.json()["message"]
    wrong = c.post("/v1/chat/completions", json={"messages": USER, "input_ids": "5 6", "max_tokens": 2})
    assert wrong.status_code == 400 and "input_ids" in wrong.json()["message"]


def test_completions_return_token_ids(served):
    """SGLang's /v1/completions return_token_ids: each choice's token_ids and prompt_token_ids (the
    text's tokenization as generate runs it); streamed, each chunk carries its new ids."""
    import json

    c, eng = served
    prompt_ids = eng.tokenizer.encode("hello there", add_special_tokens=False)
    ref = eng.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 5, **GREEDY})["output_ids"]
    body = {"prompt": "hello there", "max_tokens": 5, "return_token_ids": True, **GREEDY}
    choices = c.post("/v1/completions", json={**body, "n": 2}).json()["choices"]
    assert [ch["token_ids"] for ch in choices] == [ref, ref]
    assert all(ch["prompt_token_ids"] == prompt_ids for ch in choices)
    batch = c.post("/v1/completions", json={**body, "prompt": [prompt_ids, [5, 6, 7]]}).json()["choices"]
    assert batch[0]["token_ids"] == ref and [ch["prompt_token_ids"] for ch in batch] == [prompt_ids, [5, 6, 7]]
    assert "token_ids" not in c.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events]
    assert sum((ch["token_ids"] for ch in chunks), []) == ref
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in ch for ch in chunks[1:])
