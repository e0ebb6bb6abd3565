"""The in-process API: seeds, n > 1, stops, streaming, abort, and bad input."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from tests.engine.conftest import random_prompts


def test_sampling_seed_same_alone_and_in_batch(engine):
    vocab = engine.local_core.parts.vocab_size
    target = random_prompts(1, vocab, lengths=(20, 20), seed=11)[0]
    others = random_prompts(15, vocab, lengths=(1, 60), seed=12)
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    alone = engine.generate(input_ids=target, sampling_params=params)
    other_params = [{"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 100 + i} for i in range(15)]
    batch = engine.generate(input_ids=others[:7] + [target] + others[7:],
                            sampling_params=other_params[:7] + [params] + other_params[7:])
    assert batch[7]["output_ids"] == alone["output_ids"]
    assert alone["meta_info"]["sampling_seed"] == 1234
    different = engine.generate(input_ids=target, sampling_params={**params, "sampling_seed": 99})
    assert different["output_ids"] != alone["output_ids"]


def test_unseeded_request_reports_a_replayable_seed(engine):
    params = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    first = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
    seed = first["meta_info"]["sampling_seed"]
    replay = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={**params, "sampling_seed": seed})
    assert replay["output_ids"] == first["output_ids"]


def test_n_samples_get_distinct_seeds(engine):
    params = {"max_new_tokens": 10, "temperature": 1.0, "n": 4, "sampling_seed": 7, "ignore_eos": True}
    outs = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
    assert len(outs) == 4
    assert len({o["meta_info"]["sampling_seed"] for o in outs}) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    again = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_stop_token_ids_and_min_new_tokens(engine):
    base = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    ref = engine.generate(input_ids=[9, 10, 11], sampling_params=base)["output_ids"]
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = engine.generate(input_ids=[9, 10, 11], sampling_params={**base, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == ref[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    held = engine.generate(input_ids=[9, 10, 11],
                           sampling_params={**base, "stop_token_ids": [stop_tok], "min_new_tokens": first + 2})
    assert len(held["output_ids"]) > first + 1
    length = engine.generate(input_ids=[9, 10, 11], sampling_params={**base, "max_new_tokens": 5})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_stop_strings_trim_text(engine):
    base = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    ref = engine.generate(prompt="The quick brown fox", sampling_params=base)
    text = ref["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if len(stop.strip()) < 1:
        pytest.skip("generated text too short to pick a stop string")
    out = engine.generate(prompt="The quick brown fox", sampling_params={**base, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    kept = engine.generate(prompt="The quick brown fox", sampling_params={**base, "stop": stop, "no_stop_trim": True})
    assert kept["text"].endswith(stop) or stop in kept["text"]


def test_stop_regex_ends_at_the_first_match(engine):
    """Oracle: the greedy run without the regex. The stopped run is its prefix, ending at the
    first token whose text matches; SGLang keeps the matched text and names the pattern."""
    base = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    ref = engine.generate(prompt="The quick brown fox", sampling_params=base)
    tok = engine.local_core.tokenizer
    letters = [c for c in ref["text"][len(ref["text"]) // 2:] if c.isalpha()]
    if not letters:
        pytest.skip("generated text has no letter to stop at")
    pattern = f"{re.escape(letters[0])}.?"
    out = engine.generate(prompt="The quick brown fox", sampling_params={**base, "stop_regex": pattern})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    ids = out["output_ids"]
    assert ids == ref["output_ids"][: len(ids)] and len(ids) < len(ref["output_ids"])
    first = next(n for n in range(1, len(ref["output_ids"]) + 1)
                 if re.search(pattern, tok.decode(ref["output_ids"][:n], skip_special_tokens=True)))
    assert len(ids) == first and re.search(pattern, out["text"])
    both = engine.generate(prompt="The quick brown fox", sampling_params={**base, "stop_regex": ["^$never", pattern]})
    assert both["output_ids"] == ids and both["meta_info"]["finish_reason"]["matched"] == pattern


def test_text_prompt_round_trip(engine):
    out = engine.generate(prompt=["Hello world", "数学 🙂"], sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert len(out) == 2 and all(isinstance(o["text"], str) for o in out)
    tok = engine.local_core.tokenizer
    for o in out:
        assert o["text"] == tok.decode(o["output_ids"], skip_special_tokens=True) or o["meta_info"]["finish_reason"]["type"] == "stop"


def test_async_stream_is_cumulative(engine):
    async def run():
        chunks = []
        async for chunk in engine.async_generate(input_ids=[3, 4, 5], stream=True,
                                                 sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}):
            chunks.append(chunk)
        final = await engine.async_generate(input_ids=[3, 4, 5],
                                            sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        return chunks, final

    chunks, final = asyncio.run(run())
    lengths = [len(c["output_ids"]) for c in chunks]
    # a chunk per token, unless the reader lags (a busy host): then only the newest is delivered
    assert lengths == sorted(set(lengths)) and lengths[-1] == 6 and len(lengths) >= 2, lengths
    for earlier, later in zip(chunks, chunks[1:]):  # cumulative: each extends the one before
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_running_request(engine):
    async def run():
        stream = engine.async_generate(input_ids=[3, 4, 5], rid="to-abort", stream=True,
                                       sampling_params={"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True})
        seen = 0
        async for chunk in stream:
            seen += 1
            if seen == 3:
                engine.abort_request("to-abort")
            last = chunk
        return last

    last = asyncio.run(run())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    engine.check_integrity()


BAD_INPUTS = [
    ({"prompt": ""}, "empty"),
    ({"input_ids": []}, "input_ids"),
    ({"prompt": "hi", "input_ids": [[1, 2], [3]]}, "disagree"),
    ({"input_ids": [1, 2], "priority": 1.5}, "priority"),
    ({"input_ids": [1, 10**9]}, "vocabulary"),
    ({"input_ids": [-1, 2]}, "vocabulary"),
    ({"input_ids": [5] * 5000}, "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": -2}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"min_p": 1.5}}, "min_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus_field": 1}}, "bogus_field"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
]


@pytest.mark.parametrize("kwargs,needle", BAD_INPUTS, ids=[n for _, n in BAD_INPUTS])
def test_bad_input_is_named_and_engine_keeps_serving(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(**kwargs)
    ok = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert len(ok["output_ids"]) >= 1


def test_priority_is_taken_and_ignored_as_sglang_does_without_priority_scheduling(engine):
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = engine.generate(input_ids=[5, 6], sampling_params=params)
    assert engine.generate(input_ids=[5, 6], sampling_params=params, priority=-3)["output_ids"] == plain["output_ids"]
    assert engine.generate(input_ids=[5, 6], sampling_params=params, priority=np.int64(2))["output_ids"] == plain["output_ids"]
    with pytest.raises(ValueError, match="priority"):
        engine.generate(input_ids=[5, 6], sampling_params=params, priority=True)


def test_unknown_server_arg_is_named(tiny_model_dir):
    from engine import Engine

    with pytest.raises(ValueError, match="no_such_flag"):
        Engine(model_path=tiny_model_dir, no_such_flag=1)


def test_special_tokens_kept_when_asked(engine):
    tok = engine.local_core.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True, "min_new_tokens": 0}
    # force the special token by giving it as a stop token we then keep via no_stop_trim
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={**params, "skip_special_tokens": False})
    plain = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert out["output_ids"] == plain["output_ids"]
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=False)
    assert tok.decode([eos], skip_special_tokens=False) == "<|im_end|>"


def test_cli_generate_prints_text(tiny_model_dir, capsys):
    from tandem.main import main

    rc = main(["generate", "--model-path", tiny_model_dir, "--prompt", "Hello", "--max-new-tokens", "4",
               "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    assert "tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_forward_aborts_its_batch_without_leaking(engine_factory, overlap):
    eng = engine_factory()
    eng.local_core.overlap = overlap
    real_launch = eng.local_core.runner.launch
    calls = {"n": 0}

    def flaky(batch, inflight=None):
        calls["n"] += 1
        if calls["n"] == 3:  # fail a decode step mid-generation
            raise RuntimeError("injected failure")
        return real_launch(batch, inflight)

    eng.local_core.runner.launch = flaky
    outs = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert all(r["type"] == "abort" and "injected failure" in r["message"] for r in reasons)
    eng.check_integrity()
    ok = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert len(ok["output_ids"]) == 4
    eng.check_integrity()


@pytest.mark.parametrize("server_kwargs", [{}, {"max_total_tokens": 300, "chunked_prefill_size": 64}],
                         ids=["roomy", "retracting"])
def test_overlap_schedule_gives_the_same_outputs(engine_factory, engine, server_kwargs):
    """Overlap bookkeeping (lookahead decode steps launched before the last tokens are read)
    runs on the CPU too when forced; outputs must match the plain loop exactly."""
    vocab = engine.local_core.parts.vocab_size
    prompts = random_prompts(24, vocab, lengths=(4, 30), seed=21)
    params = [{"max_new_tokens": 5 + i % 13, "temperature": 1.0 if i % 3 else 0.0, "sampling_seed": i,
               "stop_token_ids": [7] if i % 5 == 0 else None} for i in range(24)]
    for i in (1, 8):  # sampling that reads the output so far: forward runs ahead, sampling after the commit
        params[i]["frequency_penalty"] = 1.5
    params[4]["min_new_tokens"] = 6
    params[11]["repetition_penalty"] = 1.3
    plain = engine_factory(enable_deterministic_inference=True, **server_kwargs)
    overlapped = engine_factory(enable_deterministic_inference=True, **server_kwargs)
    overlapped.local_core.overlap = True
    want = plain.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    got = overlapped.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["meta_info"]["output_token_logprobs"] for o in got] == [o["meta_info"]["output_token_logprobs"] for o in want]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in want]
    assert overlapped.local_core.stats.num_lookahead_steps > 3 and plain.local_core.stats.num_lookahead_steps == 0
    overlapped.check_integrity()


def test_prompt_logprobs_only_with_zero_new_tokens(engine):
    out = engine.generate(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in out["meta_info"]["input_token_logprobs"]] == [5, 6, 7, 8, 9]
    engine.check_integrity()


def test_failure_while_answering_does_not_hang(engine_factory):
    eng = engine_factory()
    real = eng.local_core.results.finish
    calls = {"n": 0}

    def broken(req):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("answer failed")
        return real(req)

    eng.local_core.results.finish = broken
    out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    eng.check_integrity()


def test_engine_survives_a_caller_whose_loop_closed(engine):
    async def start_and_leave():
        stream = engine.async_generate(input_ids=[3, 4, 5], rid="orphan", stream=True,
                                       sampling_params={"max_new_tokens": 50, "ignore_eos": True})
        async for _ in stream:
            break  # leave after one chunk; asyncio.run then closes the loop

    asyncio.run(start_and_leave())
    ok = engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(ok["output_ids"]) == 3
    engine.check_integrity()


def test_mixed_chunk_gives_the_same_outputs(engine_factory, engine):
    """Decode rows riding in prefill passes change nothing, bit for bit, in deterministic mode;
    prompts arrive in two waves so the second wave's chunks carry the first wave's decodes."""
    vocab = engine.local_core.parts.vocab_size
    first, second = random_prompts(6, vocab, lengths=(5, 20), seed=31), random_prompts(6, vocab, lengths=(60, 120), seed=32)
    params = {"max_new_tokens": 30, "temperature": 1.0, "sampling_seed": 4, "ignore_eos": True}

    def run(eng):
        async def go():
            a = eng.async_generate(input_ids=first, sampling_params=params, return_logprob=True)
            await asyncio.sleep(0.05)
            b = eng.async_generate(input_ids=second, sampling_params=params, return_logprob=True)
            return await a + await b
        return asyncio.run(go())

    plain = run(engine_factory(enable_deterministic_inference=True, chunked_prefill_size=32))
    mixed_engine = engine_factory(enable_deterministic_inference=True, chunked_prefill_size=32, enable_mixed_chunk=True)
    mixed = run(mixed_engine)
    assert [o["output_ids"] for o in mixed] == [o["output_ids"] for o in plain]
    assert [o["meta_info"]["output_token_logprobs"] for o in mixed] == [o["meta_info"]["output_token_logprobs"] for o in plain]
    assert mixed_engine.local_core.stats.num_mixed_steps > 0
    mixed_engine.check_integrity()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("core_text", [False, True])  # with stop strings the core builds the text
def test_matched_stop_token_is_left_out_of_the_text(engine, stream, core_text):
    """SGLang's trim_matched_stop: the stop token a reply ends on is not in its text, also where it
    prints (skip_special_tokens=False, or a plain token in stop_token_ids); no_stop_trim keeps it."""
    tok = engine.local_core.tokenizer
    free = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 6, "temperature": 0.0})
    stop = free["output_ids"][min(3, len(free["output_ids"]) - 1)]  # a plain token, or the EOS it ended on
    ids = free["output_ids"][:free["output_ids"].index(stop) + 1]  # the reply ends at its first appearance
    for keep in (False, True):
        params = {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [stop],
                  "skip_special_tokens": False, "no_stop_trim": keep}
        if core_text:
            params["stop"] = ["\x00never"]
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=params, stream=stream)
        final = list(out)[-1] if stream else out
        assert final["output_ids"] == ids and final["meta_info"]["finish_reason"]["matched"] == stop
        assert final["text"] == tok.decode(ids if keep else ids[:-1], skip_special_tokens=False)
