"""Reward functions: (sample) -> float, named by a dotted path such as "my_pkg.rewards:score"."""

from __future__ import annotations

from typing import Callable

from rollout.plugins import load_object
from rollout.types import Sample

RewardFn = Callable[[Sample], float]


def load_reward(path: str) -> RewardFn:
    """"module:function" or "module.function" -> the function; a clear error when it is not there."""
    return load_object(path, "reward")


def exact_match(sample: Sample) -> float:
    """1.0 when the response text, stripped, equals the label's string form."""
    return float(sample.text.strip() == str(sample.label).strip())


def response_parity(sample: Sample) -> float:
    """1.0 when the response's token ids sum to an even number. It varies from sample to sample
    whatever the weights, so GRPO advantages are non-zero and every step really changes the
    policy: for speed and exactness runs on random weights (it teaches nothing useful)."""
    return float(sum(sample.response_ids) % 2 == 0)
