"""Programmatic dependent launch (PDL, Hopper and later) for the small decode batch's kernels.

A batch-1 decode step of the 0.6B shape is ~280 kernels in ~1.1 ms of which ~0.3 ms is weight
bandwidth: the rest is per-kernel latency, each launch waiting for the previous kernel to drain
before its programs are even scheduled. Launched with PDL (`launch_pdl`), a kernel's programs are
scheduled while the previous kernel finishes, and each one's first act is `griddepcontrol.wait`,
which returns once that kernel has completed and its writes are visible: the same order of memory
effects as plain stream order, minus the scheduling gap. Then it lets the next kernel be scheduled
(`griddepcontrol.launch_dependents`). CUDA graphs keep these programmatic edges.

The rule every kernel taking PDL keeps: `await_inputs(PDL)` first, before any store, any load of
what a kernel writes, and any early return of any program. A kernel that touched such memory
before it, or exited without it, could complete before its predecessor and let its own successor
read unfinished results. Weights are the one thing read before it (the small-M gemv's first
tile, and an L2 prefetch of the rest of its slice, `prefetch_l2`): no kernel writes them during a
step (updates land between steps, the engine paused).

Only for batches of up to MAX_ROWS rows (decode at small batch, where latency is the cost; a
large grid's programs waiting early would hold SM slots the running kernel's later waves need),
on devices of compute capability 9.0+. The default, TANDEM_PDL=wide, also moves the wide decode
linears (qkv, gate_up) from cuBLAS, which takes no part in PDL, to the small-M gemv
(engine/kernels/small_m_linear.py), so a layer is one chain of PDL launches; =1 leaves them with
cuBLAS, =0 turns PDL off. Deterministic mode's batch-invariant matmul takes it as well, so its
decode layer is one chain too: PDL changes when a kernel's programs start, never what they compute.
Measured on an H100 (0.6B shape, batch 1, the captured decode graph alone): 1.220 ms off, 1.056 ms
with 1, 1.025 ms with wide (streamed ITL 1.254 / 1.089 / 1.055 ms).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels import env_choice

ENV = "TANDEM_PDL"
MAX_ROWS = 8


MODE = env_choice(ENV, "wide", ("0", "1", "wide"), "1 (programmatic dependent launch), wide (also the wide "
                  "linears on the small-M gemv) or 0 (off)")
ENABLED = MODE != "0"
WIDE = MODE == "wide"  # the small-M gemv takes qkv and gate_up too (no cuBLAS link in the chain)
# Before its wait a PDL gemv asks L2 for the rest of its weight slice (`prefetch_l2`), up to
# PREFETCH_BUDGET bytes over all its programs: a hint that fills the gap while the previous kernel
# finishes, never a change in what is computed. H100, bs-1 graph alone: 0.6B 1.028 -> 1.021 ms,
# 8B 5.867 -> 5.845 ms (docs/benchmarks.md).
PREFETCH = env_choice("TANDEM_GEMV_PREFETCH", "1", ("0", "1"), "1 (on, the default) or 0 (off)") == "1"
PREFETCH_BUDGET = 16 << 20  # a third of the H100's / H200's 50 MB L2: the running kernel keeps the rest
L2_LINE = 128


def use_pdl(rows: int, device: torch.device) -> bool:
    """Whether a launch over `rows` rows on `device` takes PDL."""
    return ENABLED and rows <= MAX_ROWS and device.type == "cuda" and hopper_or_later(device.index)


def launch_options(pdl: bool) -> dict:
    """The launch keyword: none without PDL (a Triton without the option still launches)."""
    return {"launch_pdl": True} if pdl else {}


@functools.lru_cache(maxsize=None)
def hopper_or_later(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_lines(programs: int, rows: int, row_bytes: int) -> int:
    """How many L2 lines of each of its `rows` weight rows (`row_bytes` each, past its first tile)
    a gemv program asks for, as a power of two (0: none): all of them rounded up (the kernel clamps
    the extra addresses to the row's last), or as many as PREFETCH_BUDGET over `programs` allows."""
    if not PREFETCH or row_bytes <= 0 or programs * rows <= 0:
        return 0
    needed = -(-row_bytes // L2_LINE)
    allowed = PREFETCH_BUDGET // (programs * rows * L2_LINE)
    if allowed == 0:
        return 0
    return 1 << (needed - 1).bit_length() if needed <= allowed else 1 << (allowed.bit_length() - 1)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (any shape): no registers held, nothing waited for. Only on
    CUDA (inline PTX): callers reach it under PDL, which the interpreter never takes."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """First in a kernel that may be launched with PDL: wait for the previous kernel to complete
    (its writes visible), then let the next kernel's programs be scheduled."""
    if PDL:  # the trigger after the wait: before it, a deeper chain of waiting programs made the
        # bs-1 graph slower (1.021 -> 1.202 ms, H100)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
