"""Deterministic mode's prefill tile: which taller tiles give the 16-row tile's bits, and how fast.

Deterministic mode runs extend (prefill) and decode on one attention tile (16 rows, 128 keys a
step), which keeps prefill = decode bitwise but prefills at ~40 TFLOP/s where normal mode's
128-row tile reaches ~60 (scripts/gpu_attention_bench.py, H100). A taller tile with the same
keys a step (block_n, the arithmetic) may or may not keep each row's bits: its row sums follow
the accumulator layout, which the tile shape picks. Measured here, not assumed: for each
candidate, extend outputs (fresh prefills and chunks over a cached prefix, shuffled KV slots)
against the default tile's, bit for bit, and the time of each.

    python scripts/det_extend_tile_probe.py [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_attention_bench as gab  # noqa: E402  (the bench's Setup, batches and timing)

CANDIDATES = [(16, 128, 4, 2), (32, 128, 4, 2), (64, 128, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2),
              (64, 128, 4, 1), (32, 128, 8, 2)]  # block_m, block_n, warps, stages


def extend(setup: gab.Setup, cfg, n_new: int, reps: int) -> tuple[torch.Tensor, float]:
    from engine.attention.split_kv_plan import KernelConfig
    from engine.attention.triton import TritonAttentionBackend

    kc = KernelConfig(*cfg, fp_fusion=False)
    tb = TritonAttentionBackend(deterministic=True, configs={"deterministic": kc, "deterministic_extend": kc})
    n_seq = max(1, min(setup.bs, 8192 // n_new))
    fb = setup.batch(tb, [(i, setup.ctx - n_new, n_new) for i in range(n_seq)], decode=False)
    q, k, v = setup.qkv(n_seq * n_new)
    run = lambda: tb.forward(q, k, v, 0, gab.D**-0.5, fb)  # noqa: E731
    tb.init_forward_metadata(fb)
    out = run().clone()
    ms = gab.time_ms(lambda: (tb.init_forward_metadata(fb), run()), reps)
    return out, ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        gab.H, gab.HKV, gab.D = 4, 2, 16
    dev = "cpu" if args.dry_run else "cuda"
    ctx, bs = (80, 3) if args.dry_run else (768, 16)
    setup = gab.Setup(bs, ctx, "shuffled", dev, torch.float32 if args.dry_run else torch.bfloat16)
    print(f"{'kind':10} {'config':18} {'ms':>8} {'same bits':>9}")
    for n_new in ((ctx, 40) if args.dry_run else (ctx, 512, 256)):
        ref = None
        for cfg in CANDIDATES:
            try:
                out, ms = extend(setup, cfg, n_new, 2 if args.dry_run else args.reps)
            except Exception as e:  # a tile that does not compile (shared memory) is a result too
                print(f"new{n_new:<7} {str(cfg):18} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            same = "ref" if ref is None else str(torch.equal(out, ref))
            ref = out if ref is None else ref
            print(f"new{n_new:<7} {str(cfg):18} {ms:8.3f} {same:>9}")


if __name__ == "__main__":
    main()
