"""trainer_bridge.losses against hand-computed values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_bridge.losses import group_advantages, kl_penalty, policy_loss


def test_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)  # std 0.5, mean 0.5
    assert torch.equal(adv[1], torch.zeros(4))  # a group that agrees teaches nothing
    assert torch.equal(group_advantages(rewards, normalize_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="groups, samples"):
        group_advantages(torch.ones(4))


def test_on_policy_gradient_is_minus_advantage_per_token():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, metrics = policy_loss(logprobs, logprobs.detach(), adv, mask)
    loss.backward()
    # ratio 1: loss = -mean(A) over 5 real tokens, d/dlogprob = -A / 5 on real tokens, 0 on padding
    assert loss.item() == pytest.approx(-(3 * 2.0 - 2 * 1.0) / 5)
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]]))
    assert metrics["clip_fraction"].item() == 0.0 and metrics["approx_kl"].item() == 0.0  # 0-dim tensors


def test_clipping_stops_the_gradient_only_where_the_objective_is_pessimistic():
    old = torch.zeros(1, 4)
    # ratios e^0.5 (above 1.2) and e^-0.5 (below 0.8), each with a positive and a negative advantage
    logprobs = torch.tensor([[0.5, 0.5, -0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, metrics = policy_loss(logprobs, old, adv, torch.ones(1, 4))
    loss.backward()
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    # A>0, r>1+eps: clipped, no grad; A<0, r>1+eps: unclipped; A>0, r<1-eps: unclipped; A<0, r<1-eps: clipped
    expected = torch.tensor([[0.0, r_hi / 4, -r_lo / 4, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert loss.item() == pytest.approx((-1.2 + r_hi - r_lo + 0.8) / 4)
    assert metrics["clip_fraction"].item() == 0.5


def test_truncated_importance_sampling_weights_and_caps():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[0.0, math.log(2.0), -math.log(4.0)]])  # weights exp(old - rollout): 1, 0.5, 4
    loss, metrics = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 3),
                                rollout_logprobs=rollout, tis_cap=2.0)
    loss.backward()
    assert torch.allclose(logprobs.grad, -torch.tensor([[1.0, 0.5, 2.0]]) / 3)  # 4 capped at 2
    assert metrics["tis_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx((math.log(2) + math.log(4)) / 3)
    same, m = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 3),
                          rollout_logprobs=logprobs.detach())
    plain, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 3))
    assert torch.equal(same, plain) and m["train_rollout_logprob_abs_diff"].item() == 0.0  # bitwise on-policy


def test_aggregations_weigh_tokens_or_sequences():
    per = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    token, _ = policy_loss(per, per.detach(), adv, mask, aggregation="token_mean")
    seq, _ = policy_loss(per, per.detach(), adv, mask, aggregation="seq_mean_token_mean")
    total, _ = policy_loss(per, per.detach(), adv, mask, aggregation="seq_mean_token_sum")
    assert (token.item(), seq.item(), total.item()) == pytest.approx((-1.0, -1.0, -2.5))
    (grad,) = torch.autograd.grad(seq, per)
    assert torch.allclose(grad, torch.tensor([[-0.125] * 4, [-0.5, 0, 0, 0]]))  # the short one weighs 4x per token
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(per, per.detach(), adv, mask, aggregation="sum")


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    ref = torch.tensor([[-1.0, -2.0]])
    assert kl_penalty(ref.clone(), ref, torch.ones(1, 2)).item() == 0.0
    moved = kl_penalty(ref + 0.3, ref, torch.ones(1, 2)).item()
    assert moved == pytest.approx(math.exp(-0.3) + 0.3 - 1.0)


def test_step_totals_equal_the_per_micro_batch_python_sums():
    """Trainer.train_step sums its micro batches on the device and reads once: the totals are the
    float64 sums the per-micro-batch .item() reads gave, bit for bit, a NaN logprob gap ignored."""
    from trainer_bridge.trainer import _accumulate

    sums, loss_sum, gap_max, mean_sum = {}, 0.0, 0.0, 0.0
    for loss, gap, mean, share in [(0.1, float("nan"), 0.3, 0.25), (0.2, 0.5, 0.1, 0.25), (0.3, 0.2, 0.7, 0.5)]:
        loss, gap, mean = torch.tensor(loss), torch.tensor(gap), torch.tensor(mean)
        _accumulate(sums, loss, {"logprob_abs_diff_max": gap, "logprob_abs_diff_mean": mean}, share)
        loss_sum, gap_max, mean_sum = loss_sum + loss.item(), max(gap_max, gap.item()), mean_sum + mean.item() * share
    totals = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
    assert (totals["loss"], totals["logprob_abs_diff_max"], totals["logprob_abs_diff_mean"]) == (loss_sum, gap_max, mean_sum)
    assert totals["kl"] == totals["tis_weight_mean"] == 0.0
