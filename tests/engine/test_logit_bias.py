"""logit_bias (SGLang's sampling param {str(token id): bias}): validation, and the sampler adding it
to the logits after the penalties and before temperature/top-k/top-p, with original logprobs
unbiased and processed ones biased; the same on the batch-invariant (deterministic) kernel."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.batch_invariant import log_softmax as bi_log_softmax
from engine.sampling.sampler import Sampler, apply_penalties
from engine.sampling.sampling_batch import SamplingBatch, SamplingRow
from engine.sampling_params import SamplingParams

V = 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _logits(rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(params: list[SamplingParams], logits: torch.Tensor, log_softmax=None, device: str = "cpu"):
    rows = [SamplingRow(p, seed=11, position=5) for p in params]
    out = Sampler(log_softmax=log_softmax).sample(logits.to(device), SamplingBatch.build(rows, V, device))
    return type(out)(*(t.cpu() for t in out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("log_softmax", [None, bi_log_softmax], ids=["torch", "batch_invariant"])
def test_plus_100_makes_greedy_and_sampled_rows_pick_the_token(log_softmax, device):
    logits = _logits()
    target = int(torch.argmin(logits[0]))  # the least likely token of row 0
    bias = {str(target): 100.0}
    params = [SamplingParams(temperature=0, logit_bias=bias), SamplingParams(temperature=1.0, logit_bias=bias)]
    out = _sample(params, logits[[0, 0]], log_softmax, device)
    assert out.next_token_ids.tolist() == [target, target]
    raw = torch.log_softmax(logits[0], dim=-1)[target]
    assert torch.allclose(out.original_logprobs, raw.expand(2), atol=1e-5)  # unbiased: the model's own
    biased = torch.log_softmax(logits[0] + torch.nn.functional.one_hot(torch.tensor(target), V) * 100, -1)
    assert torch.allclose(out.processed_logprobs, biased[target].expand(2), atol=1e-5)  # ~0: the bias counts
    assert out.processed_logprobs.min() > -1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_minus_100_bans_a_token_and_leaves_the_next_best(device):
    logits = _logits()
    best, second = torch.topk(logits[0], 2).indices.tolist()
    out = _sample([SamplingParams(temperature=0, logit_bias={str(best): -100})], logits[:1], device=device)
    assert out.next_token_ids.tolist() == [second]
    seeds = [SamplingRow(SamplingParams(logit_bias={str(best): -100}), seed=s, position=3) for s in range(300)]
    batch = SamplingBatch.build(seeds, V, device)
    sampled = Sampler().sample(logits[[0] * 300].to(device), batch).next_token_ids
    assert best not in sampled.tolist()  # p(best) < e^-90 after the bias


def test_bias_applies_after_penalties_and_only_to_its_row():
    logits = _logits()
    pen = SamplingParams(repetition_penalty=2.0, logit_bias={"3": 1.5, "4": -2.0})
    rows = [SamplingRow(pen, 0, 0, prompt_ids=[3]), SamplingRow(SamplingParams(), 0, 0)]
    got = apply_penalties(logits, SamplingBatch.build(rows, V))
    x = logits[0, 3]
    expected = (x / 2.0 if x > 0 else x * 2.0) + 1.5  # penalised first, then biased (SGLang's order)
    assert torch.isclose(got[0, 3], expected) and torch.isclose(got[0, 4], logits[0, 4] - 2.0)
    assert torch.equal(got[0, 5:], logits[0, 5:]) and torch.equal(got[1], logits[1])


def test_no_bias_builds_no_tensor():
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), 0, 0)], V)
    assert batch.logit_bias is None
    biased = SamplingBatch.build([SamplingRow(SamplingParams(logit_bias={"2": 0.5}), 0, 0)], V)
    assert biased.logit_bias.shape == (1, V) and biased.logit_bias[0, 2] == 0.5 and biased.logit_bias.sum() == 0.5


def test_keys_normalised_to_token_id_strings():
    p = SamplingParams(logit_bias={7: 1, " 8": -2.5})
    assert p.logit_bias == {"7": 1.0, "8": -2.5}
    assert p.logit_bias_ids() == ([7, 8], [1.0, -2.5])
    assert SamplingParams.from_dict(p.to_dict()).logit_bias == p.logit_bias  # recorder round trip


@pytest.mark.parametrize("bias,expect", [
    ({"abc": 1.0}, "logit_bias keys must be token ids"),
    ({"1.5": 1.0}, "logit_bias keys must be token ids"),
    ({"": 1.0}, "logit_bias keys must be token ids"),
    ({"5": "x"}, "logit_bias['5'] must be a finite number"),
    ({"5": True}, "logit_bias['5'] must be a finite number"),
    ({"5": None}, "logit_bias['5'] must be a finite number"),
    ({"5": float("inf")}, "logit_bias['5'] must be a finite number"),
    ({"5": float("nan")}, "logit_bias['5'] must be a finite number"),
    ({"5": 10 ** 400}, "logit_bias['5'] must be a finite number"),
    ({"5": 1e31}, r"logit_bias['5'] must be in [-1e+30, 1e+30], got 1e+31"),
    ({"5": -2e30}, r"logit_bias['5'] must be in [-1e+30, 1e+30], got -2e+30"),
    ([5], "logit_bias must be a dict or null, got list"),
])
def test_bad_values_name_the_field(bias, expect):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"logit_bias": bias})
    assert expect in str(err.value)


@pytest.mark.parametrize("key", ["32", "-1", "99999999999999999999"])
def test_ids_outside_the_vocab_are_refused(key):
    with pytest.raises(ValueError, match=rf"logit_bias must be keyed by token ids in \[0, 31\], got {key}"):
        SamplingParams(temperature=1.0, logit_bias={key: 1.0}).validate(vocab_size=V)
    SamplingParams(temperature=1.0, logit_bias={"31": 100, "0": -100}).validate(vocab_size=V)


def test_greedy_engine_requests_follow_the_bias(engine_factory):
    """Greedy rows with a bias go through the sampler (the runner's plain-greedy argmax skips it):
    +100 forces the token, -100 on the unbiased choice yields the runner-up; top_k 1 alike."""
    eng = engine_factory()
    prompt = [5, 6, 7, 8]
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = eng.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
    for params in ({**greedy}, {**greedy, "temperature": 1.0, "top_k": 1}):
        forced = eng.generate(input_ids=prompt, sampling_params={**params, "logit_bias": {"42": 100}})
        assert forced["output_ids"] == [42] * 3
    banned = eng.generate(input_ids=prompt, sampling_params={**greedy, "max_new_tokens": 1,
                                                              "logit_bias": {str(plain[0]): -100}})
    assert banned["output_ids"][0] != plain[0]
    assert eng.generate(input_ids=prompt, sampling_params={**greedy, "logit_bias": {}})["output_ids"] == plain
