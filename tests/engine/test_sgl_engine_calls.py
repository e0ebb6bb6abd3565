"""The calls RL frameworks make on sglang.Engine, made on tandem's Engine as they make them.

Sources (keyword names and value shapes copied from them):
- verl <= 2025-12 (verl/workers/rollout/sglang_rollout/sglang_rollout.py): `async_generate(prompt=None,
  input_ids=..., image_data=[None...], return_logprob=True)`; prompt scoring with max_new_tokens 0
  and logprob_start_len 0.
- verl's HttpServerAdapter (EngineBase): generate's keywords with None logprob options,
  custom_logit_processor=None, lora_path=None.
- SkyRL <= 2026-02 (inference_engines/sglang/sglang_engine.py): `async_generate(input_ids=[[...]],
  sampling_params={})`.
- SGLang's Engine itself: generate(stream=True) as a sync iterator, `await async_generate(stream=True)`
  as an async iterator. Its tokenizer_manager: test_sgl_tokenizer_manager.py; its launch arguments:
  test_sglang_launch_args.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from weight_sync.cuda_ipc import serialize

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}


def _norm(eng: Any) -> list:
    return eng.get_weights_by_name("model.norm.weight")


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()



# ---- generate / async_generate -------------------------------------------------------------------
def test_generate_with_engine_base_keywords(engine):
    """verl's HttpServerAdapter.generate passes every keyword, the unused ones as None."""
    out = engine.generate(prompt=None, sampling_params=GREEDY, input_ids=IDS, image_data=None, return_logprob=True,
                          logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                          custom_logit_processor=None)
    assert set(out) >= {"text", "output_ids", "meta_info"} and META_KEYS <= set(out["meta_info"])
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    rows = out["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in rows] == out["output_ids"] and all(isinstance(lp, float) for lp, _, _ in rows)


def test_sglang_engine_keywords_with_empty_values_pass(engine):
    ref = engine.generate(input_ids=IDS, sampling_params=GREEDY)
    out = engine.generate(input_ids=IDS, sampling_params=GREEDY, audio_data=None, video_data=None,
                          return_hidden_states=False, return_routed_experts=False, stream=False,
                          bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, data_parallel_rank=0,
                          external_trace_header=None, rid="sgl-kw")
    assert out["output_ids"] == ref["output_ids"] and out["meta_info"]["id"] == "sgl-kw"


def test_verl_batch_async_generate_with_none_images(engine):
    async def run():
        return await engine.async_generate(prompt=None, sampling_params=GREEDY, return_logprob=True,
                                           input_ids=[IDS, [3, 4]], image_data=[None, None])

    outs = asyncio.run(run())
    assert isinstance(outs, list) and [o["meta_info"]["prompt_tokens"] for o in outs] == [5, 2]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 6 for o in outs)


def test_verl_prompt_scoring_with_zero_new_tokens(engine):
    """verl's calculate_log_probs: max_new_tokens 0, logprob_start_len 0; it zips
    input_token_logprobs[1:] into (logprob, token id) and expects the prompt's ids back."""
    async def run():
        return await engine.async_generate(prompt=None, input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 0},
                                           return_logprob=True, logprob_start_len=0)

    out = asyncio.run(run())
    rows = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and len(rows) == len(IDS) and rows[0][0] is None
    log_probs, token_ids = zip(*[(lp, tok) for lp, tok, _ in rows[1:]])
    assert list(token_ids) == IDS[1:] and all(lp <= 0.0 for lp in log_probs)


def test_skyrl_token_in_token_out(engine):
    async def run():
        return await engine.async_generate(input_ids=[IDS, [7, 8, 9]], sampling_params={"max_new_tokens": 4})

    outs = asyncio.run(run())
    assert [len(o["output_ids"]) <= 4 for o in outs] == [True, True]
    assert {o["meta_info"]["finish_reason"]["type"] for o in outs} <= {"length", "stop"}


def test_top_and_token_ids_logprobs_shapes(engine):
    out = engine.generate(input_ids=IDS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
                          token_ids_logprob=[3, 4, 5])
    meta = out["meta_info"]
    assert len(meta["output_top_logprobs"]) == 6 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert meta["output_top_logprobs"][0][0] == meta["output_token_logprobs"][0]  # greedy: the top one
    assert [[tok for _, tok, _ in row] for row in meta["output_token_ids_logprobs"]] == [[3, 4, 5]] * 6


def test_generate_stream_is_a_sync_iterator(engine):
    ref = engine.generate(input_ids=IDS, sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=IDS, sampling_params=GREEDY, stream=True))
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and chunks[-1]["output_ids"] == ref["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    batch = list(engine.generate(input_ids=[IDS, IDS], sampling_params=GREEDY, stream=True))
    assert {c["index"] for c in batch} == {0, 1}


def test_generate_stream_closed_early_aborts(engine):
    before = engine.get_stats().num_generated_tokens
    chunks = engine.generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 2000}, stream=True,
                             rid="closed-early")
    next(chunks)
    chunks.close()
    _ends_by_abort(engine, before)


def _ends_by_abort(engine, before: int) -> None:
    deadline = time.monotonic() + 60
    while engine.get_load()[0]["num_reqs"] and time.monotonic() < deadline:  # the abort lands between steps
        time.sleep(0.01)
    assert engine.get_load()[0]["num_reqs"] == 0
    # ended by the abort, not by its length: a stream that ran on would have made all 2000 tokens
    assert engine.get_stats().num_generated_tokens - before < 1000


def test_generate_stream_dropped_unread_aborts(engine):
    """An iterator never started runs no `finally`: its weak sink finds it gone instead."""
    before = engine.get_stats().num_generated_tokens
    chunks = engine.generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 2000}, stream=True)
    del chunks
    _ends_by_abort(engine, before)


def test_async_generate_stream_left_by_break_aborts(engine):
    """SGLang's clients leave `async for` by break (a stop condition of their own): the dropped
    stream is not read again, so its request must not decode on to max_new_tokens while the
    caller's event loop lives on (a closed loop is caught otherwise)."""
    async def run():
        gen = await engine.async_generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 2000},
                                          stream=True)
        async for chunk in gen:
            if len(chunk["output_ids"]) >= 2:
                break
        del gen
        deadline = time.monotonic() + 60
        while engine.get_load()[0]["num_reqs"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return chunk

    before = engine.get_stats().num_generated_tokens
    assert len(asyncio.run(run())["output_ids"]) >= 2
    _ends_by_abort(engine, before)
    assert engine.generate(input_ids=IDS, sampling_params=GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_async_generate_awaited_under_a_timeout_aborts_when_it_fires(engine):
    """asyncio.wait_for(engine.async_generate(...), timeout): a non-streamed request sends nothing
    before its last output, so only the cancelled await can say nobody waits for it any more."""
    async def run():
        call = engine.async_generate(input_ids=[IDS, IDS], sampling_params={**GREEDY, "max_new_tokens": 2000})
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call, timeout=0.2)

    before = engine.get_stats().num_generated_tokens
    asyncio.run(run())
    _ends_by_abort(engine, before)
    assert engine.generate(input_ids=IDS, sampling_params=GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_a_task_nobody_holds_still_reads_its_stream(engine):
    """asyncio keeps tasks weakly: a task awaiting a stream, itself held by no one, must not be
    collected with the stream now that the engine holds streams weakly."""
    import gc

    async def run():
        done = asyncio.get_running_loop().create_future()

        async def consume():
            stream = await engine.async_generate(input_ids=IDS, sampling_params={**GREEDY, "max_new_tokens": 40},
                                                 stream=True)
            done.set_result([chunk async for chunk in stream][-1])

        asyncio.ensure_future(consume())  # the task is not kept
        for _ in range(20):
            gc.collect()
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(done, 20)

    assert len(asyncio.run(run())["output_ids"]) == 40


def test_awaited_async_generate_stream_is_an_async_iterator(engine):
    """SGLang: `gen = await engine.async_generate(..., stream=True)`, then `async for`."""
    async def run():
        gen = await engine.async_generate(input_ids=IDS, sampling_params=GREEDY, stream=True)
        return [chunk async for chunk in gen]

    chunks = asyncio.run(run())
    assert chunks[-1]["output_ids"] == engine.generate(input_ids=IDS, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("kwargs, named", [
    ({"image_data": ["http://x/cat.png"]}, "image_data"),
    ({"custom_logit_processor": '{"callable": "..."}'}, "custom_logit_processor"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"data_parallel_rank": 1}, "data_parallel_rank"),
    ({"session_params": {"id": "s"}}, "session_params"),
])
def test_unservable_keywords_are_refused_by_name(engine, kwargs, named):
    with pytest.raises(ValueError, match=named):
        engine.generate(input_ids=IDS, sampling_params=GREEDY, **kwargs)


def test_unknown_keyword_names_itself(engine):
    with pytest.raises(TypeError, match="return_text_in_logprob"):
        engine.generate(input_ids=IDS, sampling_params=GREEDY, return_text_in_logprob=True)


# ---- weights, memory, control --------------------------------------------------------------------
def test_update_weights_from_tensor_sglang_keywords(engine):
    before = _norm(engine)
    ok, message = engine.update_weights_from_tensor(named_tensors=[("model.norm.weight", torch.full((64,), 2.0))],
                                                    load_format=None, flush_cache=True)
    assert ok, message
    assert _norm(engine) == [2.0] * 64
    from weight_sync.bucket import FlattenedBucket

    bucket = FlattenedBucket.pack([("model.norm.weight", torch.tensor(before, dtype=torch.float32))]).to_payload()
    ok, message = engine.update_weights_from_tensor([serialize(bucket, as_text=True)], "flattened_bucket", False)
    assert ok, message  # SGLang's flattened_bucket form: one serialized bucket per TP rank
    assert _norm(engine) == before



def test_engine_control_calls(engine):
    assert engine.flush_cache() is True
    engine.abort_request(rid="", abort_all=True)
    engine.abort_request(rid="not-running")
    engine.pause_generation(mode="retract")
    engine.continue_generation()
    assert engine.release_memory_occupation(tags=["kv_cache", "weights"])[0]
    assert engine.resume_memory_occupation(tags=None)[0]
    info = engine.get_server_info()
    for key in ("model_path", "tp_size", "dtype", "enable_memory_saver", "max_total_num_tokens", "internal_states",
                "version", "skip_tokenizer_init"):
        assert key in info, key
    reply = engine.update_weights_from_disk(model_path=engine.server_args.model_path, load_format=None)
    # sglang.Engine's three values (its tokenizer manager's): success, message, num_paused_requests
    assert isinstance(reply, tuple) and len(reply) == 3, reply
    assert reply[0] is True and reply[1].startswith("Succeeded to update model weights.") and reply[2] == 0, reply
