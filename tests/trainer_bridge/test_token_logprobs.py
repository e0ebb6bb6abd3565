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


def _saved_numels(fn):
    """(fn's result, the numel of each tensor autograd saved for the backward outside checkpoints)."""
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        out = fn()
    return out, sizes


@pytest.mark.parametrize("temperature", [None, 0.8])
def test_deterministic_mode_chunks_the_head_with_the_same_bits(monkeypatch, temperature):
    """Deterministic mode's head + log_softmax by chunks recomputed in the backward: logprobs
    equal the whole batch's bit for bit (row-wise kernels), gradients agree, and no
    [rows, vocab] tensor is kept for the backward."""
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.policy import Policy

    policy = Policy.from_pretrained(str(tiny_model_path()))
    vocab = policy.model.config.vocab_size
    prompts, responses = [[5, 6, 7], [9], [3, 4]], [[11, 12, 13, 14], [14, 15, 16], list(range(20, 31))]
    rows = sum(len(r) for r in responses)

    def logprobs_and_grads():
        policy.zero_grad(set_to_none=True)
        lps, saved = _saved_numels(lambda: torch.cat(policy.rollout_logprobs(prompts, responses, temperature)))
        (lps * torch.linspace(-1, 1, rows)).sum().backward()
        return lps.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}, saved

    want, want_grads, want_saved = logprobs_and_grads()  # 18 rows: one chunk, kept
    monkeypatch.setattr(tl, "CHUNK_ROWS", 5)  # chunks of 5, 5, 5, 3
    got, got_grads, got_saved = logprobs_and_grads()
    assert torch.equal(got, want)
    for name, ref in want_grads.items():
        assert torch.allclose(got_grads[name], ref, rtol=1e-4, atol=1e-6), name
    assert max(want_saved) >= rows * vocab  # the whole batch's logits were kept...
    assert max(got_saved) < rows * vocab  # ...and now are not
    again, again_grads, _ = logprobs_and_grads()  # the chunked gradients repeat bit for bit
    assert torch.equal(again, got) and all(torch.equal(again_grads[n], g) for n, g in got_grads.items())
