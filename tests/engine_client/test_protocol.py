"""The engine surface: Engine and the HTTP client satisfy EngineAPI; GenerateRequest takes
Engine.generate's arguments (SGLang's keywords, tandem's positional order, or itself)."""

from __future__ import annotations

import pytest

from engine.api.generate_request import GenerateRequest
from engine.api.protocol import EngineAPI, answers_reply, refusal


def test_engine_and_the_http_client_satisfy_the_protocol():
    from engine import Engine
    from engine_client.http_client import HttpClient

    assert issubclass(Engine, EngineAPI) and issubclass(HttpClient, EngineAPI)
    assert answers_reply(Engine.update_weights_from_disk) and answers_reply(EngineAPI.release_memory_occupation)
    assert not answers_reply(Engine.flush_cache) and not answers_reply(Engine.generate)
    # what the Ray actor answers for a ValueError: the method's own reply shape (sglang.Engine's
    # update_weights_from_disk returns (success, message, num_paused_requests))
    assert refusal(Engine.update_weights_from_disk, "no") == (False, "no", 0)
    assert refusal(HttpClient.update_weights_from_disk, "no") == (False, "no", 0)
    assert refusal(Engine.release_memory_occupation, "no") == (False, "no")


def test_generate_request_takes_engine_generates_arguments():
    positional = GenerateRequest.of("hi", {"max_new_tokens": 2})
    assert positional == GenerateRequest(prompt="hi", sampling_params={"max_new_tokens": 2})
    assert GenerateRequest.of(positional) is positional
    keywords = GenerateRequest.of(input_ids=[1, 2], return_logprob=True, token_ids_logprob=[3], rid="r")
    assert (keywords.logprob_start_len, keywords.top_logprobs_num, keywords.logprob_distribution) == (-1, 0, None)
    with pytest.raises(ValueError, match="image_data is not supported"):  # sglang.Engine's, refused by name
        GenerateRequest.of(prompt="hi", image_data="x")
    assert GenerateRequest.of(prompt="hi", image_data=None, logprob_start_len=None) == GenerateRequest(prompt="hi")
    with pytest.raises(TypeError, match="no_such_field"):
        GenerateRequest.of(prompt="hi", no_such_field=1)
