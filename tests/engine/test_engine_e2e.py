"""End to end on the CPU: the engine against HF transformers on the tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import random_prompts

MAX_NEW = 12


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
        do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts(engine):
    return random_prompts(20, engine.local_core.parts.vocab_size, lengths=(1, 100), seed=1)


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize(
    "server_kwargs",
    [
        {},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 7, "disable_radix_cache": True},
        {"chunked_prefill_size": -1, "schedule_policy": "lpm"},
    ],
    ids=["radix", "no-radix", "chunk16", "chunk7-no-radix", "unchunked-lpm"],
)
def test_greedy_matches_hf_batched_and_alone(engine_factory, prompts, hf_outputs, server_kwargs):
    eng = engine_factory(**server_kwargs)
    batched = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batched] == hf_outputs
    for prompt, expected in zip(prompts, hf_outputs):
        assert eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == expected
    eng.check_integrity()


def test_original_logprobs_match_hf(engine, hf_model, prompts):
    outs = engine.generate(input_ids=prompts[:6], sampling_params=GREEDY, return_logprob=True)
    for prompt, out in zip(prompts[:6], outs):
        full = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logits = hf_model(full).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        entries = out["meta_info"]["output_token_logprobs"]
        assert len(entries) == MAX_NEW
        for i, (lp, tok, _) in enumerate(entries):
            assert tok == out["output_ids"][i]
            assert abs(lp - ref[len(prompt) - 1 + i, tok].item()) <= 1e-5


def test_prompt_logprobs_match_hf(engine, hf_model, prompts):
    prompt = prompts[3] if len(prompts[3]) > 10 else list(range(5, 40))
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    entries = out["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(prompt) and entries[0][0] is None
    for pos in range(1, len(prompt)):
        assert entries[pos][1] == prompt[pos]
        assert abs(entries[pos][0] - ref[pos - 1, prompt[pos]].item()) <= 1e-5
    # from the middle, after the prefix is cached: reuse is capped so the values still come out
    start = len(prompt) // 2
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start)
    tail = again["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in tail] == prompt[start:] and tail[0][0] is None  # SGLang: null first, at any start
    assert [e[0] for e in tail[1:]] == pytest.approx([e[0] for e in entries[start + 1:]], abs=1e-5)


def test_shared_prefix_hits_cache(engine_factory, engine):
    eng = engine_factory()
    vocab = engine.local_core.parts.vocab_size
    prefix = random_prompts(1, vocab, lengths=(200, 200), seed=7)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    cold = engine_factory(disable_radix_cache=True).generate(input_ids=second, sampling_params=GREEDY)
    eng.generate(input_ids=first, sampling_params=GREEDY)
    warm = eng.generate(input_ids=second, sampling_params=GREEDY)
    assert warm["meta_info"]["cached_tokens"] >= 199
    assert warm["output_ids"] == cold["output_ids"]


def test_retraction_under_small_pool(engine_factory, engine):
    vocab = engine.local_core.parts.vocab_size
    reqs = random_prompts(32, vocab, lengths=(4, 24), seed=3)
    params = {"max_new_tokens": 24, "temperature": 0.0}  # no ignore_eos: admission is optimistic
    alone = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in reqs]
    small = engine_factory(max_total_tokens=300, chunked_prefill_size=64)
    outs = small.generate(input_ids=reqs, sampling_params=params)
    assert small.local_core.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in outs] == alone
    assert any(o["meta_info"]["num_retractions"] > 0 for o in outs)
    small.check_integrity()
    assert small.flush_cache()
    small.check_integrity()


def test_top_logprobs_and_processed_distribution(engine, hf_model):
    prompt = [7, 8, 9, 10, 11]
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0.5, "sampling_seed": 3},
                          return_logprob=True, top_logprobs_num=5, logprob_distribution="processed")
    meta = out["meta_info"]
    assert meta["logprob_distribution"] == "processed"
    full = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logits = hf_model(full).logits[0].float()
    # 2e-5: a prompt whose prefix another test left in the radix cache rounds its logits ~1e-5
    # differently (prefix from the cache, the rest computed), and T = 0.5 doubles that
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        row = logits[len(prompt) - 1 + i]
        assert abs(lp - torch.log_softmax(row / 0.5, -1)[tok].item()) <= 2e-5
        top = meta["output_top_logprobs"][i]
        assert len(top) == 5
        ref_vals, ref_ids = torch.log_softmax(row / 0.5, -1).topk(5)  # top logprobs: the token's distribution
        assert [t[1] for t in top] == ref_ids.tolist()
        assert [t[0] for t in top] == pytest.approx(ref_vals.tolist(), abs=2e-5)


def test_bfloat16_on_cpu_runs_and_stays_close(engine_factory, prompts, hf_outputs):
    eng = engine_factory(dtype="bfloat16")
    outs = eng.generate(input_ids=prompts[:4], sampling_params=GREEDY)
    assert all(len(o["output_ids"]) == MAX_NEW for o in outs)
    agree = sum(a == b for o, ref in zip(outs, hf_outputs[:4]) for a, b in zip(o["output_ids"][:2], ref[:2]))
    assert agree >= 6  # bf16 rounding may flip a near-tie, not most tokens
