"""token_logprobs (the normal-mode trainer's chunked LM head + logprob) against the plain
log_softmax over full float64 logits: values and the gradients of hidden and weight, with and
without a temperature, across chunk boundaries; and in a normal-mode Policy."""

from __future__ import annotations

import pytest
import torch

from trainer_bridge import token_logprobs as tl


def _case(rows: int, vocab: int = 50, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    grad = torch.randn(rows, generator=gen)
    return hidden, weight, targets, grad


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_values_and_gradients_match_full_log_softmax(monkeypatch, temperature):
    monkeypatch.setattr(tl, "CHUNK_ROWS", 4)  # 11 rows: chunks of 4, 4, 3
    hidden, weight, targets, grad = _case(11)
    got = tl.token_logprobs(hidden, weight, targets, temperature)
    got_h, got_w = torch.autograd.grad((got * grad).sum(), (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logits = h64 @ w64.T / (temperature or 1.0)
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    want_h, want_w = torch.autograd.grad((want * grad.double()).sum(), (h64, w64))
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5
    assert (got_h.double() - want_h).abs().max() < 1e-5
    assert (got_w.double() - want_w).abs().max() < 1e-5


def test_a_normal_mode_policy_takes_it_and_agrees_with_the_full_head():
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.policy import Policy

    policy = Policy.from_pretrained(str(tiny_model_path()), batch_invariant=False)
    prompts, responses = [[5, 6, 7], [9]], [[11, 12], [14, 15, 16]]
    calls = []
    real = tl._LinearLogprob.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl._LinearLogprob, "apply", lambda *a: calls.append(1) or real(*a))
        got = torch.cat(policy.rollout_logprobs(prompts, responses, temperature=0.9))
    assert calls
    exact = Policy.from_pretrained(str(tiny_model_path()))
    want = torch.cat(exact.rollout_logprobs(prompts, responses, temperature=0.9))
    assert (got - want).abs().max() < 1e-4


def test_a_zero3_partitioned_head_goes_through_its_own_forward():
    """ZeRO-3 marks its partitioned parameters (ds_numel) and gathers them only in the module's forward."""
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.policy import Policy

    policy = Policy.from_pretrained(str(tiny_model_path()), batch_invariant=False)
    policy.model.lm_head.weight.ds_numel = policy.model.lm_head.weight.numel()
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl._LinearLogprob, "apply", lambda *a: calls.append(1))
        lps = policy.rollout_logprobs([[5, 6]], [[7, 8]])
    assert not calls and lps[0].shape == (2,)
