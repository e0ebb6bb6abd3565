"""Time the fused qk_norm_rope / silu_and_mul kernels against the unfused CUDA path they replace.

Per shape (Qwen3-0.6B, Qwen3-8B) and T in {1, 256, 4096}, bf16:
  qk_norm_rope  unfused: bi.rms_norm on q and on k (Triton, after a row copy of each strided view)
                then layers.apply_rotary on q and k (torch); fused: one in-place launch
  silu(det)     bi.silu_and_mul (torch, 5 ops)  vs the stepwise kernel
  silu(normal)  F.silu(gate) * up (torch, 2 ops) vs the F.silu-rounding kernel
Eager per-call times: CUDA events around each call, median of --reps after warm-up. Kernel counts
per call from torch.profiler. `same` = fused output bitwise equal to the unfused one.
--dry-run: the same on the CPU in Triton's interpreter at tiny sizes (checks the script only).

    python scripts/fused_kernels_bench.py [--reps 50] [--inner 1] [--ops qk_norm_rope,...] [--json out.json]
                                          [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qwen3-0.6b": (16, 8, 128, 3072), "qwen3-8b": (32, 8, 128, 12288)}  # H, Hkv, D, inter
TS = (1, 256, 4096)


def time_call(fn, reps: int, dev: str, inner: int = 1) -> float:
    """Median microseconds of one call (of `inner` calls back to back between the events, so the
    launches queue ahead of the GPU and a short kernel's time is not its launch latency)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def count_kernels(fn, dev: str) -> int:
    if dev != "cuda":
        return -1
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def cases(shape: str, T: int, dev: str):
    """(op, unfused fn, fused fn, outputs-equal fn) for one shape and T."""
    from engine.kernels import batch_invariant as bi
    from engine.kernels.qk_norm_rope import qk_norm_rope
    from engine.kernels.silu_and_mul import silu_and_mul
    from engine.models.layers import RotaryEmbedding, apply_rotary

    H, Hkv, D, inter = SHAPES[shape]
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=dev).bfloat16()
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, Hkv, D)
    qw, kw = (torch.rand(D, device=dev).bfloat16() + 0.5 for _ in range(2))
    rope = RotaryEmbedding(D, 1e6).to(dev)
    cos, sin = rope(torch.arange(T, device=dev) + 100)
    x = (torch.randn(T, 2 * inter, device=dev) * 3).bfloat16()

    def qk_unfused():
        q_n, k_n = bi.rms_norm(q, qw, 1e-6), bi.rms_norm(k, kw, 1e-6)
        return apply_rotary(q_n, cos, sin), apply_rotary(k_n, cos, sin)

    def qk_fused():  # in place, as in the model: later calls see rotated inputs (same work)
        return qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)

    def qk_same():
        before = qkv.clone()
        ref = qk_unfused()
        out = qk_fused()
        same = torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        qkv.copy_(before)
        return same

    return [
        ("qk_norm_rope", qk_unfused, qk_fused, qk_same),
        ("silu(det)", lambda: bi.silu_and_mul(x), lambda: silu_and_mul(x, True),
         lambda: torch.equal(bi.silu_and_mul(x), silu_and_mul(x, True))),
        ("silu(normal)", lambda: F.silu(x[:, :inter]) * x[:, inter:], lambda: silu_and_mul(x, False),
         lambda: torch.equal(F.silu(x[:, :inter]) * x[:, inter:], silu_and_mul(x, False))),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--inner", type=int, default=1, help="calls back to back per timed sample")
    p.add_argument("--ops", default=None, help="comma-separated ops to time (default: all)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev, ts = "cuda", TS
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        dev, ts, args.reps = "cpu", (1, 3), 2
        SHAPES.clear()
        SHAPES["tiny"] = (4, 2, 32, 96)
    torch.manual_seed(0)
    rows = []
    print(f"{'op':13s} {'shape':11s} {'T':>5s} {'unfused_us':>10s} {'fused_us':>9s} {'speedup':>7s} "
          f"{'kernels':>8s} same")
    with torch.inference_mode():
        for shape in SHAPES:
            for T in ts:
                for op, unfused, fused, same in cases(shape, T, dev):
                    if args.ops and op not in args.ops.split(","):
                        continue
                    r = dict(op=op, shape=shape, T=T, same=same(),
                             unfused_us=time_call(unfused, args.reps, dev, args.inner),
                             fused_us=time_call(fused, args.reps, dev, args.inner),
                             unfused_kernels=count_kernels(unfused, dev),
                             fused_kernels=count_kernels(fused, dev))
                    rows.append(r)
                    kernels = f"{r['unfused_kernels']}->{r['fused_kernels']}"
                    print(f"{op:13s} {shape:11s} {T:5d} {r['unfused_us']:10.1f} {r['fused_us']:9.1f} "
                          f"{r['unfused_us'] / r['fused_us']:7.2f} {kernels:>8s} "
                          f"{'yes' if r['same'] else 'NO'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
