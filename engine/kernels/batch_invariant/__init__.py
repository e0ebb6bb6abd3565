"""Batch-invariant kernels for --enable-deterministic-inference (DESIGN section 4).

`ops` is the public entry point: torch on the CPU, Triton (`triton_ops`) on CUDA.
"""

from __future__ import annotations

from engine.kernels.batch_invariant.ops import ROW_TILE, greedy_log_softmax, linear, log_softmax, rms_norm, silu_and_mul

__all__ = ["ROW_TILE", "greedy_log_softmax", "linear", "log_softmax", "rms_norm", "silu_and_mul"]
