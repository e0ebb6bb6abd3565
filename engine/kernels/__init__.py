"""Triton kernels, each imported only where it can run: `optional_kernel` is the one import that
tolerates a machine without Triton (the torch path then holds)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def optional_kernel(name: str) -> Optional[ModuleType]:
    """engine.kernels.<name>, or None where Triton does not import."""
    try:
        return importlib.import_module(f"engine.kernels.{name}")
    except ImportError:
        return None
