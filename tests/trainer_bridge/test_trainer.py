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
