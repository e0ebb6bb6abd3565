"""Triton for kernel tests: compiled where CUDA is, Triton's CPU interpreter elsewhere.

TRITON_INTERPRET must be set before triton's first import in the process, and pytest imports
every test module into one process, so each such module calls this at its top.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch


def import_triton_or_skip() -> ModuleType:
    """triton, or a module-level skip: not installed (CI), or already imported compiled on a CPU."""
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    if cpu and type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
    return triton
