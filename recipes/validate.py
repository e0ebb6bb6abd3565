"""check_fields: a Recipe's values have their field's type and a usable range.

A .py recipe or a YAML/JSON file can give any Python value (`steps: 1.5`, `lr: [1]`,
`deterministic: 3`), so the types are checked here rather than trusted; a bad value is one
ValueError naming the field, not a TypeError deep in the loop. Ints given for float fields become
floats (YAML reads `temperature: 1` as an int).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Any

# None values of Optional fields pass every check
POSITIVE_INTS = ("steps", "prompts_per_step", "num_engines", "max_new_tokens", "micro_batch_size",
                 "warm_start_batch", "bucket_bytes")
NON_NEGATIVE_INTS = ("warm_start_steps", "torch_threads", "seed")
# sane upper bounds, checked before any work (a prompts_per_step of 10**9 built 4.8 GB of prompts
# in 60 s before anything refused it): each well past any real run, none past what a machine holds
UPPER_BOUNDS = (("prompts_per_step", 1 << 14), ("n_per_prompt", 1024), ("warm_start_batch", 1 << 14),
                ("micro_batch_size", 1 << 14), ("max_new_tokens", 1 << 20), ("num_engines", 1024),
                ("steps", 10 ** 7), ("warm_start_steps", 10 ** 7), ("torch_threads", 4096), ("bucket_bytes", 1 << 40))
MAX_SAMPLES_PER_STEP = 1 << 16  # prompts_per_step x n_per_prompt (slime-scale runs use ~8k)
# (field, lower bound, bound allowed)
FLOAT_BOUNDS = (("lr", 0, False), ("warm_start_lr", 0, False), ("max_grad_norm", 0, False),
                ("clip_low", 0, True), ("clip_high", 0, True), ("kl_coef", 0, True), ("tis_cap", 0, False))


def check_fields(recipe: Any) -> None:
    """Types first (so the range checks compare numbers), then ranges."""
    hints = typing.get_type_hints(type(recipe))
    for f in dataclasses.fields(recipe):
        value = _typed(f.name, getattr(recipe, f.name), hints[f.name])
        object.__setattr__(recipe, f.name, value)  # frozen: only the int -> float widening changes it
    _check_ranges(recipe)


def _typed(name: str, value: Any, kind: Any) -> Any:
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        if value is None:
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind in (bool, str, dict) and isinstance(value, kind):
        return value
    raise ValueError(f"{name} must be {_article(kind)}, got {value!r} ({type(value).__name__})")


def _article(kind: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a mapping (a JSON object on the command line)"}.get(kind, getattr(kind, "__name__", str(kind)))


def _check_ranges(r: Any) -> None:
    for name in POSITIVE_INTS:
        if getattr(r, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(r, name)}")
    if r.n_per_prompt < 2:
        raise ValueError(f"n_per_prompt must be >= 2 (GRPO compares samples of one prompt), got {r.n_per_prompt}")
    for name, high in UPPER_BOUNDS:
        if getattr(r, name) > high:
            raise ValueError(f"{name} must be <= {high:,}, got {getattr(r, name):,}")
    if r.prompts_per_step * r.n_per_prompt > MAX_SAMPLES_PER_STEP:
        raise ValueError(f"prompts_per_step x n_per_prompt = {r.prompts_per_step * r.n_per_prompt:,} samples per "
                         f"step; the limit is {MAX_SAMPLES_PER_STEP:,}")
    if not (math.isfinite(r.temperature) and r.temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (RL samples; 0 is greedy: every sample of a "
                         f"prompt alike, nothing to compare), got {r.temperature}")
    for name, low, inclusive in FLOAT_BOUNDS:
        _check_number(name, getattr(r, name), low, inclusive)
    for name in NON_NEGATIVE_INTS:
        if getattr(r, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(r, name)}")
    if r.seed >= 1 << 64:
        raise ValueError(f"seed must be < 2**64 (torch's generator takes 64 bits), got {r.seed}")
    if r.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {r.zero_stage}")


MAX_LORA_RANK = 1024


def lora_targets(spec: str) -> tuple[str, ...]:
    """"q_proj,v_proj" or "all-linear" -> the HF module names (a ValueError names an unknown one)."""
    from engine.lora.lora_config import expand_targets

    names = [n for n in spec.replace(",", " ").split() if n]
    try:
        targets = tuple(expand_targets(names))
    except ValueError as exc:
        raise ValueError(f"lora_target_modules: {exc}") from None
    if not targets:
        raise ValueError("lora_target_modules names no module; give e.g. q_proj,v_proj or all-linear")
    return targets


def check_lora(r: Any) -> None:
    """lora_rank 0 is off; otherwise a rank, a finite alpha > 0 and known target modules."""
    if not 0 <= r.lora_rank <= MAX_LORA_RANK:
        raise ValueError(f"lora_rank must be in [0, {MAX_LORA_RANK}] (0: full-weight RL), got {r.lora_rank}")
    _check_number("lora_alpha", r.lora_alpha, 0, False)
    lora_targets(r.lora_target_modules)
    if r.lora_rank and r.trainer != "torch":
        raise ValueError(f"lora_rank > 0 trains with the torch trainer only; got trainer {r.trainer!r}")
    if r.lora_rank and r.rollout_fn:
        raise ValueError("lora_rank > 0 with a rollout_fn is not supported yet (its turns would not name the "
                         "adapter); use single-turn rollouts")


def _check_number(name: str, value: Any, low: float, inclusive: bool) -> None:
    """A finite number above `low` (None passes: the optional fields' off)."""
    if value is None:
        return
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{name} must be a finite number {'>=' if inclusive else '>'} {low}, got {value}")
