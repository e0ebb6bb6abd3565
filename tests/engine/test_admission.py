"""Admission that never waits forever (issue 14, item 2).

With a 512-token KV pool, a request whose prompt + max_new_tokens the pool (or the context) can
never hold is refused at once with a ValueError (HTTP 400) naming the limits; one that reaches
the scheduler anyway ends at once with an error; requests queued behind either are served.
"""

from __future__ import annotations

import queue
import time

import pytest

from engine.api.generate_request import GenerateRequest
from engine.api.request_builder import RequestBuilder
from engine.config import ServerArgs
from tests.engine.conftest import random_prompts

POOL = 512
OVERSIZED = [  # (prompt length, max_new_tokens)
    (10, 600),  # the output alone is larger than the pool
    (600, 1),  # the prompt alone
    (300, 300),  # together
]


@pytest.fixture(scope="module")
def small_pool(engine_factory):
    return engine_factory(max_total_tokens=POOL)


@pytest.mark.parametrize("prompt_len,max_new", OVERSIZED)
def test_a_request_the_pool_can_never_hold_is_refused_at_once(small_pool, prompt_len, max_new):
    ids = random_prompts(1, small_pool.info.vocab_size, lengths=(prompt_len, prompt_len), seed=prompt_len)[0]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{prompt_len + max_new} tokens exceed the KV cache pool of {POOL} "
                                         r"tokens.*--max-total-tokens"):
        small_pool.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new})
    assert time.perf_counter() - start < 1.0
    ok = small_pool.generate(input_ids=ids[:100], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert len(ok["output_ids"]) == 4
    small_pool.check_integrity()


def test_the_message_says_how_much_fits():
    builder = RequestBuilder(None, 1000, 4096, ServerArgs(model_path="x"), max_total_num_tokens=POOL)
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 502"):
        builder.build(GenerateRequest(input_ids=list(range(10)), sampling_params={"max_new_tokens": 600}))
    with pytest.raises(ValueError, match="maximum context length of 4096 tokens.*max_new_tokens at most 96"):
        RequestBuilder(None, 1000, 4096, ServerArgs(model_path="x")).build(
            GenerateRequest(input_ids=[5] * 4000, sampling_params={"max_new_tokens": 100}))
    exact = builder.build(GenerateRequest(input_ids=list(range(12)), sampling_params={"max_new_tokens": 500}))[0]
    assert len(exact) == 1  # prompt + max_new_tokens == pool: fits exactly


def test_http_answers_400_naming_the_limits_and_keeps_serving(small_pool):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    ids = random_prompts(1, small_pool.info.vocab_size, lengths=(300, 300), seed=4)[0]
    with TestClient(create_app(small_pool)) as client:
        for prompt_len, max_new in OVERSIZED:
            body = {"input_ids": ids[:1] * prompt_len, "sampling_params": {"max_new_tokens": max_new}}
            reply = client.post("/generate", json=body)
            assert reply.status_code == 400, reply.text
            assert f"KV cache pool of {POOL} tokens" in reply.text
        served = client.post("/generate", json={"input_ids": ids[:20], "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        assert served.status_code == 200 and len(served.json()["output_ids"]) == 3


def test_an_oversized_request_that_reaches_the_scheduler_ends_and_does_not_block_the_queue(small_pool):
    """Behind the front end's check, the scheduler refuses what an empty pool could not admit:
    it ends with an error at once and the request queued behind it is served (it used to wait
    forever at the head of the FCFS queue)."""
    unchecked = RequestBuilder(None, small_pool.info.vocab_size, small_pool.info.context_len, small_pool.server_args)
    ids = random_prompts(1, small_pool.info.vocab_size, lengths=(300, 300), seed=5)[0]
    (oversized,), _ = unchecked.build(GenerateRequest(input_ids=ids, sampling_params={"max_new_tokens": 300}))
    (normal,), _ = small_pool.builder.build(
        GenerateRequest(input_ids=ids[:30], sampling_params={"max_new_tokens": 5, "ignore_eos": True}))
    answers: "queue.Queue" = queue.Queue()
    small_pool._submit(oversized, answers.put)
    small_pool._submit(normal, answers.put)
    finals = {}
    while len(finals) < 2:
        out = answers.get(timeout=30)
        if out.finished:
            finals[out.rid] = out.output
    reason = finals[oversized.rid]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "needs 600 KV cache slots" in reason["message"] and f"holds {POOL}" in reason["message"]
    assert len(finals[normal.rid]["output_ids"]) == 5
    small_pool.check_integrity()


def test_a_request_that_fits_only_later_is_served_first_and_then_the_rest(small_pool):
    """FCFS: a request that does not fit beside the running one waits at the head until it does
    (bounded: the running one ends), and those behind it are served after, none starved."""
    vocab = small_pool.info.vocab_size
    running, big, small = random_prompts(3, vocab, lengths=(10, 10), seed=6)
    big = random_prompts(1, vocab, lengths=(250, 250), seed=7)[0]
    params = [{"max_new_tokens": 200, "ignore_eos": True},  # reserves 200 of the pool
              {"max_new_tokens": 100, "ignore_eos": True},  # 350 > what is left while the first runs
              {"max_new_tokens": 4, "ignore_eos": True}]
    outs = small_pool.generate(input_ids=[running, big, small], sampling_params=params)
    assert [len(o["output_ids"]) for o in outs] == [200, 100, 4]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    small_pool.check_integrity()
