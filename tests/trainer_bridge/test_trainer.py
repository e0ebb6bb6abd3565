"""Trainer.train_step refuses a non-finite step before it reaches the weights.

Oracle: the policy's parameters before the step (a refused step leaves them bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_bridge.test_colocate import _rollouts, engine, model_path, trainer  # noqa: F401


def _params(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.parameters()]


def _unchanged(trainer, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_is_not_applied(engine, trainer, poison):  # noqa: F811
    from trainer_bridge.rollout_batch import RolloutBatch

    samples = _rollouts(engine)
    advantages = [1.0 if s.index == 0 else -1.0 for s in samples]
    if poison == "loss":
        advantages[0] = float("nan")
    else:  # a finite loss whose gradient overflows
        next(trainer.policy.parameters()).register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = _params(trainer)
    with pytest.raises(FloatingPointError, match=("RL loss" if poison == "loss" else "gradient norm") + ".*not applied"):
        trainer.train_step(RolloutBatch.from_samples(samples, advantages), lr=1e-2)
    assert _unchanged(trainer, before)


def test_zero3_gathers_what_fused_kernels_read_themselves(monkeypatch, tmp_path):
    """ZeRO-3 gathers a module's own parameters for its forward; the MoE block reads its stacked
    experts' and attention its q/k norms' weights itself, so those are registered as theirs (on
    the H200 the 30B-A3B recipe otherwise met the experts' partitioned 1-D shards)."""
    import importlib.machinery
    import sys
    import types

    from engine.testing.tiny_model import build_tiny_model
    from trainer_bridge.deepspeed import _register_borrowed_parameters
    from trainer_bridge.policy import Policy

    registered: list[tuple[str, int]] = []
    zero = types.SimpleNamespace(register_external_parameter=lambda m, p: registered.append((type(m).__name__, id(p))))
    fake = types.ModuleType("deepspeed")  # with a __spec__: transformers' import looks deepspeed up
    fake.__spec__, fake.zero = importlib.machinery.ModuleSpec("deepspeed", None), zero
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    policy = Policy.from_pretrained(str(build_tiny_model(tmp_path / "moe", preset="tiny-moe")))
    _register_borrowed_parameters(policy)
    moe = [m for m in policy.modules() if type(m).__name__ == "SparseMoE"]
    attention = [m for m in policy.modules() if getattr(m, "qk_norm", False)]
    assert len(moe) == 2 and len(attention) == 2
    want = {("SparseMoE", id(p)) for m in moe for p in (m.experts.gate_up_proj.weight, m.experts.down_proj.weight)}
    want |= {(type(m).__name__, id(p)) for m in attention for p in (m.q_norm.weight, m.k_norm.weight)}
    assert set(registered) == want and len(registered) == len(want)
    # ZeRO-3 gathers them in the pre-forward hooks of the modules they are registered on: those
    # modules must be entered as modules (their __call__), not through a method of their own
    entered: list[str] = []
    for m in moe + attention:
        m.register_forward_pre_hook(lambda mod, args: entered.append(type(mod).__name__))
    policy(torch.tensor([5, 6, 7, 8, 9]), [2, 3])
    assert sorted(entered) == ["Attention", "Attention", "SparseMoE", "SparseMoE"]
