"""logit_bias over HTTP: SGLang's sampling_params.logit_bias on /generate and OpenAI's logit_bias
on /v1/completions and /v1/chat/completions (the openai package sends {"token id": bias}); bad
values are a 400 naming the field."""

from __future__ import annotations

import pytest

PROMPT = [5, 6, 7, 8]
TOKEN = 42


def _gen(client, **sampling) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, **sampling}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_plus_100_forces_the_token_and_original_logprobs_stay_the_models(client):
    out = _gen(client, temperature=1.0, sampling_seed=3, logit_bias={str(TOKEN): 100})
    assert out["output_ids"] == [TOKEN] * 4
    # the same tokens scored by a prefill without any bias: the model's own (original) logprobs
    scored = client.post("/generate", json={
        "input_ids": PROMPT + [TOKEN] * 4, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": len(PROMPT)}).json()
    want = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][1:]]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got[1:] == pytest.approx(want, abs=1e-4) and max(got) < -1.0  # not ~0: unbiased
    processed = client.post("/generate", json={
        "input_ids": PROMPT, "return_logprob": True, "logprob_distribution": "processed",
        "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "logit_bias": {str(TOKEN): 100}}}).json()
    assert all(lp > -1e-3 for lp, _, _ in processed["meta_info"]["output_token_logprobs"])  # biased: ~1


def test_sglang_sized_bias_bans_the_best_token(client):
    """SGLang clients ban with biases far outside OpenAI's +-100 (no range there): accepted."""
    top = client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    (_, best, _), (_, second, _) = top["meta_info"]["output_top_logprobs"][0]
    out = _gen(client, temperature=0, max_new_tokens=1, logit_bias={str(best): -1e4})
    assert out["output_ids"] == [second]


def test_minus_100_bans_the_best_token(client):
    top = client.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    (_, best, _), (_, second, _) = top["meta_info"]["output_top_logprobs"][0]
    out = _gen(client, temperature=1e-3, max_new_tokens=1, logit_bias={str(best): -100})
    assert out["output_ids"] == [second]


def test_openai_completions_logit_bias(client, engine):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.7, "logprobs": 1, "logit_bias": {str(TOKEN): 100}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    text = engine.tokenizer.decode([TOKEN])
    assert choice["logprobs"]["tokens"] == [text] * 3 and choice["text"] == text * 3
    unbiased = client.post("/v1/completions", json={**body, "logit_bias": {}}).json()["choices"][0]
    assert unbiased["logprobs"]["tokens"] != [text] * 3  # {} is no bias


def test_openai_chat_logit_bias(client, engine):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "temperature": 0.5,
            "logprobs": True, "logit_bias": {str(TOKEN): 100.0}}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [engine.tokenizer.decode([TOKEN])] * 3


@pytest.mark.parametrize("bias,expect", [
    ({"1024": 1.0}, "logit_bias must be keyed by token ids in [0, 1023], got 1024"),
    ({"-3": 1.0}, "logit_bias must be keyed by token ids in [0, 1023], got -3"),
    ({"abc": 1.0}, "logit_bias keys must be token ids"),
    ({"5": "x"}, "logit_bias['5'] must be a finite number"),
    ({"5": 1e31}, "logit_bias['5'] must be in [-1e+30, 1e+30]"),
    ([1, 2], "logit_bias"),
])
@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(client, route, bias, expect):
    body = {"/generate": {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "logit_bias": bias}},
            "/v1/completions": {"prompt": "hi", "logit_bias": bias},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "logit_bias": bias}}[route]
    resp = client.post(route, json=body)
    assert resp.status_code == 400 and expect in resp.json()["message"], resp.text


def test_greedy_completion_with_bias_picks_the_token(client, engine):
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                "logit_bias": {str(TOKEN): 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == engine.tokenizer.decode([TOKEN]) * 2
