"""Newer SGLang fields: `return_prompt_token_ids` on /generate (each output's prompt ids, beside
text and meta_info, streamed chunks too), and the sampling-support outputs Miles' score centering asks for
(`sampling_logprobs_mode="support"`, `return_sampling_mask`), which tandem does not compute: a 400
naming them, never a 200 whose logprobs silently mean something else (io_struct.py GenerateReqInput)."""

from __future__ import annotations

import json

import pytest

GEN = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi there"}]


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("field, value", [("sampling_logprobs_mode", "support"), ("sampling_logprobs_mode", "bogus"),
                                          ("return_sampling_mask", True)])
@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {**GEN, "top_k": 5}, "return_logprob": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "top_k": 5, "logprobs": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 5, "logprobs": 1})])
def test_sampling_support_outputs_are_refused_by_name(client, path, body, field, value):
    resp = client.post(path, json={**body, field: value})
    assert resp.status_code == 400, resp.text
    assert f"{field} is not supported" in resp.json()["message"], resp.text


def test_the_selected_mode_and_empty_values_are_what_tandem_does(client):
    body = {"input_ids": [5, 6, 7], "sampling_params": GEN, "return_logprob": True}
    plain = _ok(client.post("/generate", json=body))
    same = _ok(client.post("/generate", json={**body, "sampling_logprobs_mode": "selected",
                                              "return_sampling_mask": False}))
    # the same outputs (the second prefill hits the radix cache: logprobs within float32 rounding)
    assert same["output_ids"] == plain["output_ids"]
    assert [lp for lp, *_ in same["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [lp for lp, *_ in plain["meta_info"]["output_token_logprobs"]], abs=1e-4)
    _ok(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "sampling_logprobs_mode": None}))


def test_the_engine_refuses_them_too(engine):
    with pytest.raises(ValueError, match="sampling_logprobs_mode is not supported"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GEN, sampling_logprobs_mode="support")
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=GEN, sampling_logprobs_mode="selected",
                          return_sampling_mask=None, return_prompt_token_ids=True)
    assert out["prompt_token_ids"] == [5, 6, 7]


def test_generate_returns_prompt_token_ids_when_asked(client, engine):
    text = _ok(client.post("/generate", json={"text": "hi there", "sampling_params": GEN,
                                              "return_prompt_token_ids": True}))
    assert text["prompt_token_ids"] == engine.tokenizer.encode("hi there")
    assert len(text["prompt_token_ids"]) == text["meta_info"]["prompt_tokens"]
    batch = _ok(client.post("/generate", json={"input_ids": [[5, 6], [7, 8, 9]], "return_prompt_token_ids": True,
                                               "sampling_params": {**GEN, "n": 2}}))
    assert [o["prompt_token_ids"] for o in batch] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    assert "prompt_token_ids" not in _ok(client.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN}))


def test_a_stream_carries_the_prompt_ids_in_every_chunk(client):
    body = {"input_ids": [5, 6, 7], "sampling_params": GEN, "stream": True, "return_prompt_token_ids": True}
    with client.stream("POST", "/generate", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2 and all(c["prompt_token_ids"] == [5, 6, 7] for c in chunks)
