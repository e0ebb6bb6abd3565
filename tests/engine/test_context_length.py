"""The context-length check, as SGLang's tokenizer manager makes it (`_validate_one_request`).

SGLang 0.5.23 (tokenizer_manager.py; `>` since sgl-project/sglang#22546, 0.5.9 had `>=`):
- a prompt of context_len tokens or more: ValueError "The input (N tokens) is longer than the
  model's context length (C tokens)." -> HTTP 400;
- prompt + max_new_tokens over context_len (exactly context_len fits): ValueError "Requested token
  count exceeds the model's maximum context length of C tokens. You requested a total of T
  tokens: ..." -> HTTP 400 (clamped only under --allow-auto-truncate, which tandem does not have);
- a max_new_tokens left out is not checked there: the scheduler caps the default at the room the
  prompt leaves, without a word.
Clients detect an over-long prompt by those words, so tandem's messages start with them and then
say what to do.
"""

from __future__ import annotations

import pytest

from engine.api.generate_request import GenerateRequest
from engine.api.request_builder import RequestBuilder
from engine.config import ServerArgs

CONTEXT = 4096
TOTAL_WORDS = "Requested token count exceeds the model's maximum context length of 4096 tokens."


def _builder(pool=None) -> RequestBuilder:
    return RequestBuilder(None, 1000, CONTEXT, ServerArgs(model_path="x"), max_total_num_tokens=pool)


def _max_new(builder: RequestBuilder, prompt_len: int, params) -> int:
    (req,), _ = builder.build(GenerateRequest(input_ids=[5] * prompt_len, sampling_params=params))
    return req.sampling_params.max_new_tokens


def test_prompt_plus_max_new_tokens_may_equal_the_context_length():
    assert _max_new(_builder(), 4000, {"max_new_tokens": 96}) == 96
    assert _max_new(_builder(), CONTEXT - 1, {"max_new_tokens": 1}) == 1


def test_over_the_context_length_is_refused_in_sglangs_words_and_says_what_fits():
    with pytest.raises(ValueError) as refused:
        _builder().build(GenerateRequest(input_ids=[5] * 4000, sampling_params={"max_new_tokens": 97}))
    text = str(refused.value)
    assert text.startswith(f"{TOTAL_WORDS} You requested a total of 4097 tokens: 4000 tokens from the input "
                           "messages and 97 tokens for the completion. Please reduce the number of tokens in the "
                           "input messages or the completion to fit within the limit"), text
    assert "max_new_tokens at most 96" in text


def test_a_prompt_of_the_context_length_is_refused_in_sglangs_words():
    with pytest.raises(ValueError, match=r"^The input \(4096 tokens\) is longer than the model's context length "
                                         r"\(4096 tokens\)\. .*--context-length"):
        _builder().build(GenerateRequest(input_ids=[5] * CONTEXT, sampling_params={"max_new_tokens": 0}))


def test_a_left_out_max_new_tokens_is_capped_at_the_room_not_refused():
    builder = _builder()
    assert _max_new(builder, 4000, {}) == 96  # the default 128, capped
    assert _max_new(builder, 4000, None) == 96
    assert _max_new(builder, 100, {"temperature": 0.0}) == 128  # the default where it fits
    assert _max_new(builder, 4000, {"max_new_tokens": None}) == 96  # null: the room, as before
    with pytest.raises(ValueError, match="maximum context length of 4096 tokens"):
        _max_new(builder, 4000, {"max_new_tokens": 128})  # set by the caller: checked
    reqs, _ = builder.build(GenerateRequest(input_ids=[[5] * 4000, [5] * 4000],
                                            sampling_params=[{}, {"max_new_tokens": 50}]))
    assert [r.sampling_params.max_new_tokens for r in reqs] == [96, 50]
    assert _max_new(_builder(pool=512), 450, {}) == 62  # the KV pool's room too
    with pytest.raises(ValueError, match="min_new_tokens 100 does not fit"):
        _max_new(builder, 4000, {"min_new_tokens": 100})


def test_http_generate_at_and_over_the_context_length(engine_factory):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    eng = engine_factory()
    context = eng.info.context_len
    prompt = [5] * (context - 6)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with TestClient(create_app(eng)) as client:
        exact = client.post("/generate", json={"input_ids": prompt, "sampling_params": {**greedy, "max_new_tokens": 6}})
        assert exact.status_code == 200, exact.text
        assert len(exact.json()["output_ids"]) == 6  # all of them, up to the context length
        over = client.post("/generate", json={"input_ids": prompt, "sampling_params": {**greedy, "max_new_tokens": 7}})
        assert over.status_code == 400
        assert over.json()["message"].startswith(f"Requested token count exceeds the model's maximum context length "
                                                 f"of {context} tokens. You requested a total of {context + 1} tokens")
        capped = client.post("/generate", json={"input_ids": prompt, "sampling_params": greedy})
        assert capped.status_code == 200, capped.text
        assert len(capped.json()["output_ids"]) == 6 and capped.json()["meta_info"]["finish_reason"]["type"] == "length"
        long = client.post("/generate", json={"input_ids": [5] * context, "sampling_params": greedy})
        assert long.status_code == 400
        assert long.json()["message"].startswith(f"The input ({context} tokens) is longer than the model's context "
                                                 f"length ({context} tokens).")
    eng.check_integrity()
