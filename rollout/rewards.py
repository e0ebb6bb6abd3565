"""Reward functions: (sample) -> float, named by a dotted path such as "my_pkg.rewards:score"."""

from __future__ import annotations

import math
from typing import Callable, Optional

from rollout.plugins import load_object, plugin_error
from rollout.types import Sample

RewardFn = Callable[[Sample], float]


def load_reward(path: str) -> RewardFn:
    """"module:function" or "module.function" -> the function; a clear error when it is not there."""
    return load_object(path, "reward")


def checked_reward(fn: RewardFn, path: str, low: float = 0.0, high: float = 1.0) -> RewardFn:
    """fn, whose every answer must be a finite number in [low, high]: what GRPO's advantages and
    the run's accuracy (reward >= 1) assume. A reward that raises, returns None, a string, NaN
    or 5.0 stops the run with one line naming it and the sample, not a NaN loss steps later."""
    def reward(sample: Sample) -> float:
        try:
            value = fn(sample)
        except Exception as exc:
            raise plugin_error("reward", path, exc, f"on the response {sample.text!r}") from exc
        number = _as_float(value)
        if number is None:
            raise ValueError(f"reward {path!r} returned {value!r} ({type(value).__name__}) for the response "
                             f"{sample.text!r}: a reward is a float in [{low:g}, {high:g}]")
        value = number
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"reward {path!r} returned {value!r} for the response {sample.text!r}: a reward is "
                             f"a float in [{low:g}, {high:g}]")
        return value

    return reward


def _as_float(value: object) -> Optional[float]:
    """A number (numpy and 0-d torch scalars too) as a float; None for anything else."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return None


def exact_match(sample: Sample) -> float:
    """1.0 when the response text, stripped, equals the label's string form."""
    return float(sample.text.strip() == str(sample.label).strip())


def response_parity(sample: Sample) -> float:
    """1.0 when the response's token ids sum to an even number. It varies from sample to sample
    whatever the weights, so GRPO advantages are non-zero and every step really changes the
    policy: for speed and exactness runs on random weights (it teaches nothing useful)."""
    return float(sum(sample.response_ids) % 2 == 0)
