"""Triton for kernel tests: compiled where CUDA is, Triton's CPU interpreter elsewhere.

TRITON_INTERPRET must be set before triton's first import in the process, and pytest imports
every test module into one process, so each such module calls this at its top.

The interpreter runs `tl.dot` as numpy's matmul, whose BLAS kernel is chosen by the CPU: some
(OpenBLAS's Haswell kernels, on AVX2 machines) give a row a result that depends on the other rows
of its tile. A GPU's tensor-core dot does not, and the batch-invariance tests check the kernels'
schedules, not numpy's BLAS: `row_invariant_interpreter_dot` makes the interpreter's dot compute
each output element on its own (einsum's plain loops), the same on every CPU, and multiplies bf16
operands as their values (the stock interpreter's dot multiplies their uint16 bit patterns).
"""

from __future__ import annotations

import os
import sys
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


def import_compiled_triton_or_skip() -> ModuleType:
    """triton for a GPU test module, or a module-level skip: not installed, or already imported in
    interpreter mode by another module of this session (nothing would compile)."""
    triton = pytest.importorskip("triton")
    if type(triton.language.standard.cdiv).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs in interpreter mode in this session; run tests/gpu on its own",
                    allow_module_level=True)
    return triton


def _bf16_as_fp32(x):
    """The interpreter keeps bf16 as raw uint16 bits (its own dot multiplies those): widen exactly."""
    import numpy as np
    from triton import language as tl

    if x.dtype.scalar != tl.bfloat16:
        return x.data
    return (x.data.astype(np.uint32) << 16).view(np.float32)


def row_invariant_interpreter_dot() -> bool:
    """Patch the interpreter's tl.dot (see above) when triton runs interpreted in this process.
    -> whether it was patched (False: no interpreted triton, or a triton without this builder)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
        return False
    import numpy as np
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "row_invariant", False):
        return original is not None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating() for x in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # fp8: not used here
        a_data, b_data = (_bf16_as_fp32(x) for x in (a, b))
        out = np.einsum("...ik,...kj->...ij", a_data, b_data, dtype=d.data.dtype, optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    create_dot.row_invariant = True
    builder.create_dot = create_dot
    return True
