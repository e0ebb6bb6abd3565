"""A normal-mode trainer's Policy runs torch code under autograd (cuBLAS linears, torch norms and
activation, VarlenAttention, torch's log_softmax): the same functions as the batch-invariant
kernels, so logprobs and gradients agree to float32 rounding; deterministic mode keeps the
batch-invariant kernels (the engine's bits)."""

from __future__ import annotations

import dataclasses

import torch

from engine.models.decoder import Attention
from engine.models.layers import Linear, RMSNorm, SiluAndMul
from engine.testing.tiny_model import tiny_model_path
from trainer_bridge.policy import Policy

PROMPTS = [[5, 6, 7, 8], [9, 10]]
RESPONSES = [[11, 12, 13], [14, 15, 16, 17, 18]]


def _logprobs_and_grads(policy: Policy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logprobs = torch.cat(policy.rollout_logprobs(PROMPTS, RESPONSES))
    logprobs.sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in policy.named_parameters()}


def test_normal_mode_agrees_with_the_batch_invariant_kernels():
    from trainer_bridge.packed_attention import PackedAttention
    from trainer_bridge.varlen_attention import VarlenAttention

    path = str(tiny_model_path())
    exact = Policy.from_pretrained(path)
    fast = Policy.from_pretrained(path, batch_invariant=False)
    assert not any(m.deterministic for m in fast.modules() if isinstance(m, Linear))
    assert all(m.autograd_ops is not None for m in fast.modules() if isinstance(m, (RMSNorm, SiluAndMul, Attention)))
    assert all(m.deterministic for m in exact.modules() if isinstance(m, (Linear, RMSNorm, SiluAndMul)))
    assert all(m.autograd_ops is None for m in exact.modules() if isinstance(m, (RMSNorm, SiluAndMul, Attention)))
    assert isinstance(fast.attention, VarlenAttention) and isinstance(exact.attention, PackedAttention)
    want, want_grads = _logprobs_and_grads(exact)
    got, got_grads = _logprobs_and_grads(fast)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert grad is not None and got_grads[name] is not None, name
        assert torch.allclose(got_grads[name], grad, atol=1e-4, rtol=1e-3), name


def test_the_recipe_picks_batch_invariant_kernels_in_deterministic_mode_only():
    from recipes.recipe import Recipe
    from tandem.rl.model_source import ModelSource
    from tandem.rl.trainer_setup import build_trainer

    source = ModelSource.resolve("tiny")
    base = Recipe(name="t", model="tiny", dtype="float32", device="cpu", trainer="torch")
    for deterministic in (True, False):
        trainer = build_trainer(dataclasses.replace(base, deterministic=deterministic), source)
        flags = {m.deterministic for m in trainer.policy.modules() if isinstance(m, Linear)}
        assert flags == {deterministic}


def test_the_cpu_takes_the_torch_code_for_autograd_ops():
    from engine.models.layers import TorchOps
    from trainer_bridge.liger_ops import LigerOps, autograd_ops

    ops = autograd_ops(torch.device("cpu"))
    assert isinstance(ops, TorchOps) and not isinstance(ops, LigerOps)
