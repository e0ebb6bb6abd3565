"""Is cuBLAS batch-invariant under some setting? A row of F.linear at M rows vs the same row at
--max-m rows, bit for bit, for the Qwen3-8B layer shapes, under each BLAS library torch offers.

Deterministic mode runs its own Triton matmul because cuBLAS picks kernels (tiles, split-K) by M,
and its decode linears cost 1.15-1.3x cuBLAS's at M = 256 (docs/benchmarks.md): most of the
det-cost row's 6.8%. Without split-K (CUBLAS_WORKSPACE_CONFIG=:0:0 leaves it no workspace) every
tile of sm_90 may run the same chain of k16 MMA steps, as the Triton kernel's do; if so, some
setting gives invariant rows at cuBLAS's speed. Run it once per CUBLAS_WORKSPACE_CONFIG value
(the variable is read when cuBLAS starts). Prints, per library and shape, the Ms whose rows differ
and F.linear's time at M = 256.

    CUBLAS_WORKSPACE_CONFIG=:0:0 python scripts/cublas_invariance_probe.py [--device cpu --small]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
MS = (1, 2, 3, 4, 7, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 511, 768, 1024, 2048, 4096, 8191)  # decode, prefill chunks


def differing_ms(x: torch.Tensor, w: torch.Tensor, ms: tuple[int, ...]) -> list[int]:
    """The Ms at which some row of F.linear(x[:M]) differs from that row at all of x's rows."""
    full = F.linear(x, w)
    return [m for m in ms if m <= x.shape[0] and not torch.equal(F.linear(x[:m], w), full[:m])]


def linear_us(x: torch.Tensor, w: torch.Tensor, reps: int = 50) -> float:
    if x.device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        F.linear(x, w)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-m", type=int, default=8192)
    p.add_argument("--small", action="store_true", help="shapes / 64 (a CPU check of the script)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    libraries = ["cublas", "cublaslt"] if args.device == "cuda" else ["default"]
    print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}")
    gen = torch.Generator(args.device).manual_seed(0)
    for library in libraries:
        if library != "default":
            torch.backends.cuda.preferred_blas_library(library)
        for name, (n, k) in SHAPES.items():
            n, k = (n // 64, k // 64) if args.small else (n, k)
            w = torch.randn(n, k, device=args.device, dtype=dtype, generator=gen) * 0.02
            x = torch.randn(args.max_m, k, device=args.device, dtype=dtype, generator=gen)
            try:
                bad, us = differing_ms(x, w, MS), linear_us(x[:256], w)
            except RuntimeError as exc:  # cuBLASLt refuses to run without a workspace (:0:0)
                print(f"{library:9s} {name:8s} {exc}")
                break
            print(f"{library:9s} {name:8s} differ at M = {bad or 'none'}  F.linear M=256 {us:.1f} us")


if __name__ == "__main__":
    main()
