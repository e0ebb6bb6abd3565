from __future__ import annotations

import re

import pytest
import torch

from engine.sampling.logprobs import gather_token_logprobs, original_logprobs, top_logprobs
from engine.sampling.sampler import Sampler, apply_penalties
from engine.sampling.sampling_batch import SamplingBatch, SamplingRow
from engine.sampling.seeds import derive_seed, lowbias32, uniform_noise
from engine.sampling_params import SamplingParams

V = 64
PROBS5 = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


def _batch(params: list[SamplingParams], vocab: int = V, seed: int = 7, positions=None, **kw):
    positions = positions if positions is not None else [10] * len(params)
    rows = [SamplingRow(p, seed, pos, **kw) for p, pos in zip(params, positions)]
    return SamplingBatch.build(rows, vocab, "cpu")


def _draws(params: SamplingParams, logits_row: torch.Tensor, n: int = 20000, seed: int = 123):
    """n samples of one distribution, varying only the position counter."""
    batch = _batch([params] * n, vocab=logits_row.shape[0], seed=seed, positions=list(range(n)))
    out = Sampler().sample(logits_row.expand(n, -1).contiguous(), batch)
    return out, torch.bincount(out.next_token_ids, minlength=logits_row.shape[0]).double() / n


# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", 0, "top_k"),
        ("top_k", -2, "top_k"),
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("max_new_tokens", -1, "max_new_tokens must be >= 0"),
        ("min_new_tokens", -1, "min_new_tokens"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in [1e-06, 2]"),
        ("repetition_penalty", -1.0, "repetition_penalty"),
        ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.5, "frequency_penalty"),
        ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2]"),
        ("n", 0, "n must be >= 1"),
    ],
)
def test_bad_values_name_the_field(field, value, expect):
    with pytest.raises(ValueError, match=re.escape(expect)):
        SamplingParams.from_dict({field: value}).validate(V)


def test_min_new_tokens_above_max():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5}).validate()


def test_stop_token_ids_outside_vocab():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": [V]}).validate(V)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": [-1]}).validate()
    SamplingParams.from_dict({"stop_token_ids": [V - 1]}).validate(V)


def test_unknown_field_lists_allowed():
    with pytest.raises(ValueError, match="temprature") as err:
        SamplingParams.from_dict({"temprature": 0.5})
    assert "temperature" in str(err.value) and "allowed" in str(err.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", 1.5), ("max_new_tokens", True), ("top_k", "5"), ("n", None),
        ("temperature", "hot"), ("temperature", True), ("ignore_eos", 1), ("stop", 5),
        ("stop", ["a", 1]), ("stop_token_ids", [1, "2"]), ("stop_token_ids", [True]),
        ("sampling_seed", 1.0), ("regex", 3),
    ],
)
def test_wrong_type_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_defaults_and_normalisation():
    p = SamplingParams.from_dict(None).validate()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n) == (128, 1.0, 1.0, -1, 1)
    assert p.stop is None and p.sampling_seed is None and not p.is_greedy
    q = SamplingParams.from_dict({"stop": "</s>", "temperature": 1, "stop_token_ids": (3, 4)})
    assert q.stop == ["</s>"] and q.stop_token_ids == [3, 4]
    assert isinstance(q.temperature, float)
    assert SamplingParams.from_dict({"temperature": 0}).is_greedy
    assert SamplingParams.from_dict({"temperature": 5e-7}).is_greedy
    assert SamplingParams.from_dict({"top_k": 1}).is_greedy


def test_stop_regex_normalised_and_checked():
    assert SamplingParams.from_dict({"stop_regex": "a+b"}).validate().stop_regex == ["a+b"]
    assert SamplingParams.from_dict({"stop_regex": ["x", "y\\d"]}).validate().stop_regex == ["x", "y\\d"]
    with pytest.raises(ValueError, match="stop_regex '\\(' is not a valid regular expression"):
        SamplingParams.from_dict({"stop_regex": "("}).validate()
    with pytest.raises(ValueError, match="stop_regex must be a string or a list of strings"):
        SamplingParams.from_dict({"stop_regex": 3})


# ---- seeds and noise ------------------------------------------------------------------


def _lowbias32_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_lowbias32_matches_uint32_reference():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    got = lowbias32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32_ref(x) for x in xs]


def test_noise_depends_on_seed_and_position():
    def u(seed, pos):
        return uniform_noise(torch.tensor([seed]), torch.tensor([pos]), 1000)

    base = u(5, 100)
    for other in (u(5, 101), u(6, 100), u(5 + (1 << 32), 100), u(-5, 100)):
        assert (base != other).float().mean() > 0.99
    assert torch.equal(base, u(5, 100))
    assert 0 < base.min() and base.max() < 1
    big = uniform_noise(torch.arange(64), torch.arange(64), 4096)
    assert abs(big.mean().item() - 0.5) < 0.005


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_same_on_cuda_and_cpu():
    seeds, positions = torch.tensor([0, -3, 1 << 40, 99]), torch.tensor([0, 7, 123456, 1 << 33])
    cpu = uniform_noise(seeds, positions, 50000)
    assert torch.equal(uniform_noise(seeds.cuda(), positions.cuda(), 50000).cpu(), cpu)


def test_derive_seed():
    seeds = [derive_seed(42, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < (1 << 63) for s in seeds)
    assert seeds[3] == derive_seed(42, 3) != derive_seed(43, 3)


# ---- sampler --------------------------------------------------------------------------


def test_greedy_is_argmax_and_top_k_1_matches():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # tie -> lowest id
    greedy = Sampler().sample(logits, _batch([SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(greedy.next_token_ids, torch.argmax(logits, dim=-1))
    assert greedy.next_token_ids[3] == 5
    top1 = Sampler().sample(logits, _batch([SamplingParams(top_k=1, temperature=0.7)] * 8))
    assert torch.equal(top1.next_token_ids, greedy.next_token_ids)


def _mixed_params(i: int) -> SamplingParams:
    choices = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.05),
        SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5),
    ]
    return choices[i % len(choices)]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_batch_independence(device):
    torch.manual_seed(1)
    vocab, B = 1000, 16
    logits = (torch.randn(B, vocab) * 3).to(device)
    rows = [
        SamplingRow(_mixed_params(i), seed=1000 + i, position=50 + 3 * i,
                    prompt_ids=[i, i + 1], output_ids=[7, 7, i + 2], suppress_ids=[0])
        for i in range(B)
    ]
    full = Sampler().sample(logits, SamplingBatch.build(rows, vocab, device))
    perm = torch.randperm(B, device=device)
    permuted = [rows[i] for i in perm.tolist()]
    shuffled = Sampler().sample(logits[perm], SamplingBatch.build(permuted, vocab, device))
    for j in range(B):
        alone = Sampler().sample(logits[j : j + 1], SamplingBatch.build([rows[j]], vocab, device))
        for a, b in zip(alone, full):
            assert torch.equal(a[0], b[j]), j
    for a, b in zip(shuffled, full):
        assert torch.equal(a, b[perm])
    eager = Sampler(compile=False).sample(logits, SamplingBatch.build(rows, vocab, device))
    assert torch.equal(eager.next_token_ids, full.next_token_ids)  # compiled noise on CUDA


def test_a_row_without_top_p_is_never_cut_when_a_neighbour_uses_it():
    """float32 cumsum of a sorted softmax passes 1.0 in the tail (on every x86 capability), so a
    top_p = 1 row must be exempt from the top-p cut rather than compared against 1.0; otherwise
    its processed logprob depends on whether another row switched top-p on (issue 14, item 9)."""
    from engine.sampling.sampler import _truncation_mask

    torch.manual_seed(1)
    vocab = 1000
    logits = torch.randn(16, vocab) * 3
    rows = [SamplingParams(temperature=0.7)] + [SamplingParams(temperature=0.7, top_p=0.9)] * 15
    batch = _batch(rows, vocab=vocab)
    x = logits / batch.temperatures
    assert not _truncation_mask(x, batch)[0].any()
    assert _truncation_mask(x, batch)[1:].any(dim=-1).all()  # the top_p rows are cut
    alone = Sampler().sample(logits[:1], _batch(rows[:1], vocab=vocab))
    together = Sampler().sample(logits, batch)
    for a, b in zip(alone, together):
        assert torch.equal(a[0], b[0])


def test_seeded_sampling_repeats_and_varies():
    torch.manual_seed(2)
    logits = torch.randn(1, 5000).expand(64, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * 64
    a = Sampler().sample(logits, _batch(params, vocab=5000, seed=1, positions=list(range(64))))
    b = Sampler().sample(logits, _batch(params, vocab=5000, seed=1, positions=list(range(64))))
    c = Sampler().sample(logits, _batch(params, vocab=5000, seed=2, positions=list(range(64))))
    assert torch.equal(a.next_token_ids, b.next_token_ids)
    assert not torch.equal(a.next_token_ids, c.next_token_ids)
    assert len(set(a.next_token_ids.tolist())) > 32  # positions give different draws


def test_empirical_distribution_temperature_1():
    _, freq = _draws(SamplingParams(temperature=1.0), PROBS5.log())
    assert torch.allclose(freq, PROBS5.double(), atol=0.01), freq


@pytest.mark.parametrize(
    "params,keep",
    [
        (SamplingParams(top_p=0.75), [0, 1, 2]),  # mass before token 2 = 0.7 <= 0.75 < 0.85
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.4 = 0.12
        (SamplingParams(top_k=4, top_p=0.5), [0, 1]),
    ],
)
def test_truncation_never_samples_masked_and_renormalises(params, keep):
    out, freq = _draws(params, PROBS5.log())
    expected = torch.zeros(5, dtype=torch.float64)
    expected[keep] = PROBS5[keep].double() / PROBS5[keep].sum()
    masked = [i for i in range(5) if i not in keep]
    assert freq[masked].sum() == 0
    assert torch.allclose(freq, expected, atol=0.01), freq
    exp_lp = expected.log().float()[out.next_token_ids]
    assert torch.allclose(out.processed_logprobs, exp_lp, atol=1e-5)


def test_original_logprobs_exact_and_unchanged_by_processing():
    torch.manual_seed(3)
    logits = torch.randn(6, V) * 4
    ref = torch.log_softmax(logits, dim=-1)
    for params in (SamplingParams(), SamplingParams(temperature=0.5, top_p=0.8),
                   SamplingParams(temperature=2.0, top_k=5, min_p=0.1)):
        out = Sampler().sample(logits, _batch([params] * 6))
        assert torch.equal(out.original_logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0])
    plain = Sampler().sample(logits, _batch([SamplingParams()] * 6))
    assert torch.equal(plain.processed_logprobs, plain.original_logprobs)
    hot = Sampler().sample(logits, _batch([SamplingParams(temperature=0.5)] * 6))
    assert not torch.allclose(hot.processed_logprobs, hot.original_logprobs)
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, hot.next_token_ids[:, None])[:, 0]
    assert torch.allclose(hot.processed_logprobs, expected)


def test_unit_temperature_takes_one_log_softmax_with_the_same_tokens_and_bits(monkeypatch):
    """T = 1 with nothing else reshaping the distribution (GRPO's rollouts): no division and one
    [B, V] log_softmax serves as both distributions, where a temperature, a penalty or a cut still
    takes its own; tokens and logprobs bit for bit what dividing by 1 and a second log_softmax give
    (a batch with a greedy row too)."""
    import engine.sampling.sampler as sampler_mod

    torch.manual_seed(5)
    logits = torch.randn(4, V) * 3
    calls = []
    real = torch.log_softmax
    monkeypatch.setattr(sampler_mod.torch, "log_softmax", lambda x, dim: calls.append(1) or real(x, dim=dim))
    cases = [([SamplingParams()] * 3 + [SamplingParams(temperature=0.0)], 1),
             ([SamplingParams(temperature=0.7)] * 4, 2), ([SamplingParams(top_k=5)] * 4, 2),
             ([SamplingParams(frequency_penalty=0.5)] * 4, 2), ([SamplingParams(top_p=0.9)] * 4, 2),
             ([SamplingParams(min_p=0.1)] * 4, 2), ([SamplingParams(logit_bias={"3": 2.0})] * 4, 2)]
    for params, log_softmaxes in cases:
        batch = _batch(params)
        calls.clear()
        out, original, processed = Sampler().sample_with_distributions(logits, batch)
        assert len(calls) == log_softmaxes and (original is processed) == (log_softmaxes == 1)
        ref_processed = real(apply_penalties(logits, batch) / batch.temperatures, dim=-1)
        if log_softmaxes == 1:
            assert torch.equal(processed, ref_processed) and torch.equal(original, real(logits, dim=-1))
            assert torch.equal(out.next_token_ids, Sampler()._pick(logits, ref_processed, batch))
        assert torch.equal(out.original_logprobs, real(logits, dim=-1).gather(1, out.next_token_ids[:, None])[:, 0])


def test_repetition_penalty_matches_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(4)
    logits = torch.randn(3, V) * 2
    prompts, outputs = [[1, 2, 3], [4, 4], [10, 20]], [[5, 1], [6], [20, 30, 31]]
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.3), 0, 0, p, o)
            for p, o in zip(prompts, outputs)]
    got = apply_penalties(logits, SamplingBatch.build(rows, V))
    hf = RepetitionPenaltyLogitsProcessor(1.3)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        expected = hf(torch.tensor([p + o]), logits[i : i + 1].clone())[0]
        assert torch.allclose(got[i], expected, rtol=0, atol=1e-6)


def test_frequency_and_presence_penalties():
    torch.manual_seed(5)
    logits = torch.randn(1, V)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(params, 0, 0, prompt_ids=[9], output_ids=[3, 3, 3, 7])
    got = apply_penalties(logits, SamplingBatch.build([row], V))[0]
    expected = logits[0].clone()
    expected[3] -= 0.5 * 3 + 0.25
    expected[7] -= 0.5 * 1 + 0.25  # the prompt token 9 is not penalised
    assert torch.allclose(got, expected, atol=1e-6)


def test_min_new_tokens_suppresses_eos():
    logits = torch.zeros(2, V)
    logits[:, 2] = 50.0  # EOS id 2 dominates
    params = SamplingParams(min_new_tokens=3)
    rows = [SamplingRow(params, 0, 5, output_ids=[8], suppress_ids=[2]),
            SamplingRow(params, 0, 5, output_ids=[8, 8, 8], suppress_ids=[2])]
    for temp in (0.0, 1.0):
        rows[0].params = rows[1].params = SamplingParams(min_new_tokens=3, temperature=temp)
        out = Sampler().sample(logits, SamplingBatch.build(rows, V))
        assert out.next_token_ids[0] != 2 and out.next_token_ids[1] == 2


def test_logprob_helpers():
    torch.manual_seed(6)
    logits = torch.randn(4, V).half()
    lp = original_logprobs(logits)
    assert lp.dtype == torch.float32
    assert torch.equal(lp, torch.log_softmax(logits.float(), dim=-1))
    ids = torch.tensor([0, 5, 7, 63])
    assert torch.equal(gather_token_logprobs(lp, ids), lp[torch.arange(4), ids])
    values, top_ids = top_logprobs(logits, 3)
    assert values.shape == (4, 3) and torch.equal(top_ids[:, 0], lp.argmax(-1))
    assert torch.equal(values, lp.gather(1, top_ids))
