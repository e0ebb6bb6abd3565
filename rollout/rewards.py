"""Reward functions: (sample) -> float, named by a dotted path such as "my_pkg.rewards:score"."""

from __future__ import annotations

import importlib
from typing import Callable

from rollout.types import Sample

RewardFn = Callable[[Sample], float]


def load_reward(path: str) -> RewardFn:
    """"module:function" or "module.function" -> the function; a clear error when it is not there."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward {path!r}: use 'module:function' (or 'module.function')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {module_name!r} has no function {attr!r}")
    return fn


def exact_match(sample: Sample) -> float:
    """1.0 when the response text, stripped, equals the label's string form."""
    return float(sample.text.strip() == str(sample.label).strip())
