"""GRPO / PPO policy losses over packed response tokens, with truncated importance sampling (TIS).

Tensors are [B, T] (responses padded to T) with a 0/1 `mask` of real response tokens:
  logprobs         the trainer's, with grad, under the current parameters
  old_logprobs     the trainer's at rollout time (no grad); with a single update per rollout
                   batch they equal `logprobs` in value and the ratio is 1
  rollout_logprobs what the engine returned. If trainer and engine disagree (they do unless the
                   engine runs deterministic mode and the trainer uses trainer_bridge.policy),
                   the samples came from a slightly different policy: TIS multiplies each token's
                   loss by min(exp(old - rollout), tis_cap), detached (Yao et al., 2025).
The clipped objective is PPO's, with separate low/high clip ranges (DAPO's clip-higher);
`group_advantages` is GRPO's (std normalisation optional: Dr. GRPO drops it). Aggregations
follow verl's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from engine.kernels.device_copy import h2d

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass(frozen=True)
class LossConfig:
    """The knobs of `rl_objective`. tis_cap None: uncapped IS weights; kl_coef 0: no reference."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: Optional[float] = 2.0
    kl_coef: float = 0.0
    aggregation: str = "token_mean"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {self.aggregation!r}")
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError("clip_low, clip_high and kl_coef must be >= 0")


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (n samples of each of G prompts) -> advantages [G, n]: the reward minus its
    group's mean, divided by the group's std when normalize_std."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {list(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                rollout_logprobs: Optional[torch.Tensor] = None, tis_cap: Optional[float] = 2.0,
                aggregation: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (scalar loss to minimise, metrics as detached 0-dim tensors: read with .item() once the
    step is queued, not per micro batch, so the host never waits for the device mid-step).
    advantages: [B] (one per sequence) or [B, T]."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}")
    if not logprobs.shape == old_logprobs.shape == mask.shape:
        raise ValueError(f"logprobs {list(logprobs.shape)}, old_logprobs {list(old_logprobs.shape)} and "
                         f"mask {list(mask.shape)} must have one shape")
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    metrics: dict[str, torch.Tensor] = {
        "clip_fraction": _masked_mean(((-adv * clipped) > (-adv * ratio)).to(mask.dtype), mask).detach(),
        "approx_kl": _masked_mean(0.5 * (logprobs - old_logprobs).detach() ** 2, mask),
    }
    if rollout_logprobs is not None:
        gap = (old_logprobs - rollout_logprobs).detach()
        weight = torch.exp(gap) if tis_cap is None else torch.exp(gap).clamp(max=tis_cap)
        per_token = per_token * weight
        metrics["train_rollout_logprob_abs_diff"] = _masked_mean(gap.abs(), mask)
        metrics["tis_weight_mean"] = _masked_mean(weight, mask)
    return _aggregate(per_token, mask, aggregation), metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference), token mean: exp(r) - r - 1 with r = ref - policy
    (non-negative, unbiased; GRPO's choice)."""
    r = ref_logprobs.detach() - logprobs
    return _masked_mean(torch.exp(r) - r - 1.0, mask.to(logprobs.dtype))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    if aggregation == "token_mean":  # every token of the batch weighs the same (DAPO)
        return _masked_mean(per_token, mask)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    per_seq = (per_token * mask).sum(dim=1)
    if aggregation == "seq_mean_token_mean":  # every sequence weighs the same (GRPO paper)
        per_seq = per_seq / lengths
    return per_seq.mean()  # seq_mean_token_sum: longer sequences weigh more


def rl_objective(logprobs: Sequence[torch.Tensor], batch, config: LossConfig,
                 ref_logprobs: Optional[Sequence[torch.Tensor]] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one (micro) batch with one update per rollout batch: old = current logprobs,
    detached (ratio 1), TIS against the engine's rollout logprobs, plus kl_coef * KL to the
    reference. batch: a trainer_bridge.rollout_batch.RolloutBatch; logprobs: the trainer's, one
    tensor per response. The loss is scaled by the batch's share of its parent so micro-batch
    losses add up to the whole batch's. Metrics include the trainer/rollout logprob gap on the
    policy's own tokens (loss mask 1): logprob_abs_diff_max / _mean. Metrics are 0-dim tensors,
    as policy_loss's."""
    device = logprobs[0].device
    current = torch.nn.utils.rnn.pad_sequence(list(logprobs), batch_first=True).float()
    # built on the host, then queued behind the forward (h2d): a pageable copy per padded row made
    # the host wait for the forward to finish before it could queue the loss and the backward
    mask, rollout, advantages = (h2d(t, device) for t in (
        batch.padded(batch.loss_masks), batch.padded(batch.rollout_logprobs),
        torch.tensor(batch.advantages, dtype=torch.float32)))
    loss, metrics = policy_loss(current, current.detach(), advantages, mask, config.clip_low, config.clip_high,
                                rollout, config.tis_cap, config.aggregation)
    gap = ((current.detach() - rollout).abs() * mask)
    metrics["logprob_abs_diff_max"] = gap.max() if gap.numel() else gap.new_zeros(())
    metrics["logprob_abs_diff_mean"] = _masked_mean(gap, mask)
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        ref = torch.nn.utils.rnn.pad_sequence(list(ref_logprobs), batch_first=True).float()
        kl = kl_penalty(current, ref, mask)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.detach()
    share = batch.token_share if config.aggregation == "token_mean" else batch.seq_share
    return loss * share, metrics
