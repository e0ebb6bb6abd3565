"""Triton kernels, each imported only where it can run: `optional_kernel` is the one import that
tolerates a machine without Triton (the torch path then holds)."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def optional_kernel(name: str) -> Optional[ModuleType]:
    """engine.kernels.<name>, or None where Triton does not import."""
    try:
        return importlib.import_module(f"engine.kernels.{name}")
    except ImportError:
        return None


def env_choice(name: str, default: str, choices: tuple[str, ...], meaning: str) -> str:
    """The kernels' switch `name`, lowercased (unset or empty: `default`); a value not in `choices`
    is a ValueError saying what to use (`meaning`, e.g. "1 (on) or 0 (off)")."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use {meaning}")
    return value
