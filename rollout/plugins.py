"""load_object: plug-ins (task factory, reward, rollout function) by dotted path, for recipes and rollouts."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(path: str, what: str) -> Any:
    """"module:name" (or "module.name") -> the callable; errors name the recipe field `what`."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r}: use 'module:function' (or 'module.function')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r} ({exc})") from exc
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {module_name!r} has no callable {attr!r}")
    return obj
