"""Benchmark + check the batch-invariant Triton kernels against cuBLAS / torch on one CUDA GPU.

For the Qwen3-8B layer shapes and M in {1, 8, 64, 256, 4096}: bi_linear vs F.linear (cuBLAS) time,
bitwise row invariance across M (every row of M vs the same rows at M=4096, a reversed batch,
and the "par" vs "seq" schedules), error vs an fp32 reference, achieved TB/s and TFLOP/s.
Then bi_rms_norm / bi_log_softmax vs torch at M in {1, 256, 4096}.

Timing: CUDA graphs of R back-to-back calls (launch overhead out, as in CUDA-graph decode),
median of --reps replays divided by R; eager per-call events too. L2: each of the R calls uses
its own weight/input copy, with all copies together >= 3x the L2, so weights come from HBM.
--configs sweeps candidate tile configs per shape (one compile per config and schedule);
same_bits_as_reference: the candidate's output equals, bit for bit, that of the first config run
with the same arithmetic (split_k, dot precision); None for that first config itself.
--dry-run runs it all on the CPU in Triton's interpreter at tiny shapes (checks the script only).

    python scripts/bi_matmul_bench.py [--configs [NAMES]] [--shapes qkv,o] [--ms 1,64] [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
triton_ops = triton_matmul = None  # imported in setup(), after --dry-run sets TRITON_INTERPRET
DEV = "cuda"

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
MS = (1, 8, 64, 256, 4096)
PEAK_BW, PEAK_FLOPS = 3.8e12, 790e12  # measured-ish H200 ceilings (copy engine, cuBLAS bf16)
# Candidate overrides of the table entry, per shape kind ("split": shapes with split_k > 0).
CANDIDATES = {
    # same split_k as the table (same arithmetic): tiles for small M, then for large M
    "split": {"n64s6": dict(block_n=64, num_stages=6),
              "n64k128s4": dict(block_n=64, block_k=128, num_stages=4),
              "k128s4": dict(block_k=128, num_stages=4),
              "s6": dict(num_stages=6),
              "m128w8": dict(block_m=128, num_warps=8, num_stages=3),
              "m128w8nest4": dict(block_m=128, num_warps=8, num_stages=4, flat=False),
              "m128w8nest3": dict(block_m=128, num_warps=8, num_stages=3, flat=False),
              "m128n256w8nest": dict(block_m=128, block_n=256, num_warps=8, num_stages=3, flat=False),
              "m256w8nest": dict(block_m=256, num_warps=8, num_stages=3, flat=False),
              # M ~ 256 on wide N (gate_up): compute bound, wave quantization decides
              "m64n256w8nest": dict(block_n=256, num_warps=8, num_stages=4, flat=False),
              "m64n256w4nest": dict(block_n=256, num_warps=4, num_stages=4, flat=False),
              "m128n256w8nest4": dict(block_m=128, block_n=256, num_warps=8, num_stages=4, flat=False),
              "m128w8nest4g4": dict(block_m=128, num_warps=8, num_stages=4, flat=False, group_m=4),
              "m128w4nest4": dict(block_m=128, num_warps=4, num_stages=4, flat=False),
              "m128k128w8nest3": dict(block_m=128, block_k=128, num_warps=8, num_stages=3, flat=False),
              "m128k128w4nest3": dict(block_m=128, block_k=128, num_warps=4, num_stages=3, flat=False),
              "m128w8nest5": dict(block_m=128, num_warps=8, num_stages=5, flat=False),
              "m128w8nest4g16": dict(block_m=128, num_warps=8, num_stages=4, flat=False, group_m=16),
              "m64n256k128w4nest2": dict(block_n=256, block_k=128, num_warps=4, num_stages=2, flat=False),
              # other arithmetic (more, shorter splits: more programs at M = 1..64); "same" is
              # False by design: a candidate for the table entry itself, every tier re-checked
              "sk512": dict(split_k=512),
              "sk512n256w8": dict(split_k=512, block_n=256, num_warps=8, num_stages=3),
              # small M: a 16-row tile (MMA v2, not wgmma: bits checked, not assumed)
              "m16": dict(block_m=16),
              "m16n64s6": dict(block_m=16, block_n=64, num_stages=6),
              "m16k128s4": dict(block_m=16, block_k=128, num_stages=4),
              "m16n64s8": dict(block_m=16, block_n=64, num_stages=8),
              "m16n32s8": dict(block_m=16, block_n=32, num_stages=8),
              "m32": dict(block_m=32),
              "m32n64s6": dict(block_m=32, block_n=64, num_stages=6),
              "m32k128s4": dict(block_m=32, block_k=128, num_stages=4),
              "sk512n64s6": dict(split_k=512, block_n=64, num_stages=6),
              "sk512k128s4": dict(split_k=512, block_k=128, num_stages=4),
              "sk512m16": dict(split_k=512, block_m=16),
              "sk512m16k128": dict(split_k=512, block_m=16, block_k=128, num_stages=4),
              "sk256": dict(split_k=256),
              "sk1024": dict(split_k=1024),
              # fewer splits (less fp32 partial traffic at M ~ 64) or none (parallelism from
              # narrow column tiles instead): other arithmetic, compared among themselves
              "sk2048": dict(split_k=2048),
              "sk2048m16": dict(split_k=2048, block_m=16),
              "sk2048m16n64s6": dict(split_k=2048, block_m=16, block_n=64, num_stages=6),
              "sk2048m32": dict(split_k=2048, block_m=32),
              "sk2048n64s6": dict(split_k=2048, block_n=64, num_stages=6),
              "sk0m16n32s8": dict(split_k=0, block_m=16, block_n=32, num_stages=8),
              "sk0m16n32k128s6": dict(split_k=0, block_m=16, block_n=32, block_k=128, num_stages=6),
              "sk0n32k128s6": dict(split_k=0, block_n=32, block_k=128, num_stages=6),
              "sk0n32s8": dict(split_k=0, block_n=32, num_stages=8),
              "sk0m32n32s8": dict(split_k=0, block_m=32, block_n=32, num_stages=8),
              "sk0wide": dict(split_k=0, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
              "sk2048wide": dict(split_k=2048, block_m=128, block_n=256, block_k=64, num_warps=8,
                                 num_stages=3, flat=False),
              # what a 512 split would cost at large M (the production large-M tile)
              "sk512wide": dict(split_k=512, block_m=128, block_n=256, block_k=64, num_warps=8,
                                num_stages=3, flat=False)},
    "nosplit": {"m128n256w8": dict(block_m=128, block_n=256, num_warps=8, num_stages=3),
                "m128n256w8s4": dict(block_m=128, block_n=256, num_warps=8, num_stages=4),
                "m256n128w8s3": dict(block_m=256, block_n=128, num_warps=8, num_stages=3),
                "n256w4": dict(block_n=256, num_stages=3),
                "m128w8": dict(block_m=128, num_warps=8, num_stages=4)},
    # no split (one accumulator over all of K): tile shapes for an M ladder; --base-split0
    "ladder": {"n32k128s6": dict(block_n=32, block_k=128, num_stages=6),
               "n32k64s8": dict(block_n=32, block_k=64, num_stages=8),
               "n64k128s5": dict(block_n=64, block_k=128, num_stages=5),
               "n64k64s8": dict(block_n=64, block_k=64, num_stages=8),
               "n128s4": dict(block_n=128, num_stages=4),
               "m128n128w8": dict(block_m=128, block_n=128, num_warps=8, num_stages=4),
               "m128n256w8s3": dict(block_m=128, block_n=256, num_warps=8, num_stages=3),
               "m128n256w8s4": dict(block_m=128, block_n=256, num_warps=8, num_stages=4),
               "m256n128w8s3": dict(block_m=256, block_n=128, num_warps=8, num_stages=3)},
}


def time_calls(calls, reps: int, graph: bool) -> float:
    """Median microseconds per call; calls are cycled so each touches its own buffers."""
    for c in calls:
        c()
    if DEV == "cpu":  # --dry-run: wall clock, one pass
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        g.replay()
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        del g
    else:
        for i in range(reps * len(calls)):
            start.record()
            calls[i % len(calls)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def make_copies(N: int, K: int, l2: int, gen: torch.Generator, m_max: int):
    n = max(1, min(8, math.ceil(3 * l2 / (2 * N * K))))
    ws = [(torch.randn(N, K, device=DEV, generator=gen) * K**-0.5).to(torch.bfloat16) for _ in range(n)]
    xs = [torch.randn(m_max, K, device=DEV, generator=gen).to(torch.bfloat16) for _ in range(n)]
    return ws, xs


def bench_config(name, N, K, cfg, ws, xs, ref, base_out, args):
    """Checks and times one config on one shape; returns rows (one per M) and its M=max output."""
    w0, x0 = ws[0], xs[0]
    full = triton_ops.bi_linear(x0, w0, config=cfg)
    rel = ((full.float() - ref).norm() / ref.norm()).item()
    same_as_ref = None if base_out is None else torch.equal(full, base_out)  # first of its arithmetic
    rows = []
    for M in args.ms:
        out = triton_ops.bi_linear(x0[:M], w0, config=cfg)
        inv = torch.equal(out, full[:M])
        inv &= torch.equal(triton_ops.bi_linear(x0[:M].flip(0), w0, config=cfg), full[:M].flip(0))
        cfg_m = cfg or triton_ops.matmul_config(N, K, torch.bfloat16, M)  # None: the table's M tiers
        sched = triton_matmul.choose_schedule(M, N, K, cfg_m, x0.device)
        row = dict(shape=name, N=N, K=K, M=M, config=dataclasses.asdict(cfg_m), schedule=sched,
                   rel_err=rel, same_bits_as_reference=same_as_ref)
        both = cfg_m.num_splits(K) > 1 and M <= 256
        for s in ("par", "seq") if both else ():
            inv &= torch.equal(triton_ops.bi_linear(x0[:M], w0, config=cfg, schedule=s), full[:M])
            calls = [lambda w=w, x=x, s=s: triton_ops.bi_linear(x[:M], w, config=cfg, schedule=s)
                     for w, x in zip(ws, xs)]
            row[f"{s}_us"] = time_calls(calls, args.reps, True)
        calls = [lambda w=w, x=x: triton_ops.bi_linear(x[:M], w, config=cfg) for w, x in zip(ws, xs)]
        row["ours_us"] = row.get(f"{sched}_us") or time_calls(calls, args.reps, True)
        if not args.sweep:
            row["ours_eager_us"] = time_calls(calls, args.reps, False)
        row["invariant"] = bool(inv)
        flops, nbytes = 2 * M * N * K, 2 * (M * K + N * K + M * N)
        row["tflops"] = flops / row["ours_us"] / 1e6
        row["tbps"] = nbytes / row["ours_us"] / 1e6
        row["roofline_us"] = max(flops / PEAK_FLOPS, nbytes / PEAK_BW) * 1e6
        rows.append(row)
    return rows, full


def _arithmetic(cfg, K: int) -> tuple:
    """What fixes the bits (module doc of triton_matmul): split boundaries and dot precision."""
    return (cfg.split_k if cfg.num_splits(K) > 1 else 0, cfg.dot_precision)


def bench_shape(name, args, l2, gen):
    N, K = SHAPES[name]
    ws, xs = make_copies(N, K, l2, gen, max(args.ms))
    ref = F.linear(xs[0].float(), ws[0].float())  # fp32, TF32 off
    cublas = {}
    for M in args.ms:
        calls = [lambda w=w, x=x: F.linear(x[:M], w) for w, x in zip(ws, xs)]
        eager = None if args.sweep else time_calls(calls, args.reps, False)
        cublas[M] = (time_calls(calls, args.reps, True), eager)
    base = triton_ops.matmul_config(N, K, torch.bfloat16)
    if args.base_split0:  # reference = the table tile without split-K (one K accumulator)
        base = dataclasses.replace(base, split_k=0)
    configs = {"table": base if args.base_split0 else None}  # None: what bi_linear picks per M
    if args.sweep:
        kind = "ladder" if args.base_split0 else "split" if base.num_splits(K) > 1 else "nosplit"
        for cname, over in CANDIDATES[kind].items():
            if args.candidates and cname not in args.candidates:
                continue
            configs[cname] = dataclasses.replace(base, **over)
    rows, first_out = [], {}  # arithmetic (split_k, precision) -> output of its first config
    for cname, cfg in configs.items():
        t0 = time.time()
        arith = _arithmetic(cfg or base, K)
        try:
            crow, out = bench_config(name, N, K, cfg, ws, xs, ref, first_out.get(arith), args)
        except Exception as e:  # a candidate that fails to compile must not end the sweep
            print(f"  {name} {cname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        first_out.setdefault(arith, out)
        for r in crow:
            r["config_name"] = cname
            r["cublas_us"], r["cublas_eager_us"] = cublas[r["M"]]
            r["ratio"] = r["ours_us"] / r["cublas_us"]
        rows += crow
        print(f"  {name:8s} {cname:11s} {time.time() - t0:5.1f}s  " + "  ".join(
            f"M={r['M']}:{r['ratio']:.2f}{'' if r['invariant'] else '!NOTINV'}" for r in crow), flush=True)
    del ws, xs, ref
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def bench_norms(args):
    """bi_rms_norm (with/without residual) and bi_log_softmax vs torch; row 0 alone vs in the batch."""
    rows = []
    H, V = (4096, 151936) if DEV == "cuda" else (256, 5000)
    for M in (1, 256, 4096) if DEV == "cuda" else (1, 8):
        x = torch.randn(M, H, device=DEV, dtype=torch.bfloat16)
        r = torch.randn(M, H, device=DEV, dtype=torch.bfloat16)
        w = torch.rand(H, device=DEV, dtype=torch.bfloat16) + 0.5
        logits = torch.randn(M, V, device=DEV, dtype=torch.bfloat16) * 4
        cases = {  # op: (ours on rows [:m] -> first output, torch)
            "rms_norm": (lambda m: triton_ops.bi_rms_norm(x[:m], w, 1e-6),
                         lambda: F.rms_norm(x, (H,), w, 1e-6)),
            "rms_norm+res": (lambda m: triton_ops.bi_rms_norm(x[:m], w, 1e-6, r[:m])[0],
                             lambda: (F.rms_norm(x + r, (H,), w, 1e-6), x + r)),
            "log_softmax": (lambda m: triton_ops.bi_log_softmax(logits[:m]),
                            lambda: torch.log_softmax(logits, -1, dtype=torch.float32)),
        }
        for op, (ours, theirs) in cases.items():
            inv = torch.equal(ours(M)[:1], ours(1))
            t_ours = time_calls([lambda: ours(M)], args.reps, True)
            t_torch = time_calls([theirs], args.reps, True)
            rows.append(dict(op=op, M=M, ours_us=t_ours, torch_us=t_torch, ratio=t_ours / t_torch,
                             invariant=inv))
    return rows


def setup(args):
    """Imports the kernels (after TRITON_INTERPRET for --dry-run); returns (device name, L2 bytes)."""
    global DEV, MS, triton_ops, triton_matmul
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, MS = "cpu", (1, 8, 64)
    from engine.kernels.batch_invariant import triton_matmul, triton_ops  # noqa: F401

    if args.dry_run:  # tiny stand-ins with the same structure: split and unsplit K, partial tiles
        SHAPES.clear()
        SHAPES.update({"qkv": (96, 256), "lm_head": (200, 128)})
        small = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, par_max_tiles=8)
        triton_ops.set_config(96, 256, torch.bfloat16, triton_matmul.MatmulConfig(split_k=64, **small))
        triton_ops.set_config(200, 128, torch.bfloat16, triton_matmul.MatmulConfig(split_k=0, **small))
        return "cpu (dry run, Triton interpreter)", 1 << 20
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    name = f"{props.name} SMs={props.multi_processor_count} L2={props.L2_cache_size >> 20}MB"
    return name, props.L2_cache_size


def print_tables(rows, norm_rows, sweep: bool) -> None:
    """Detailed rows (in a sweep: the table config and each shape's best); then one line a config."""
    by_cfg: dict[tuple, list] = {}
    for r in rows:
        by_cfg.setdefault((r["shape"], r["config_name"]), []).append(r)
    worst = {key: max(r["ratio"] for r in rs) if all(r["invariant"] for r in rs) else float("inf")
             for key, rs in by_cfg.items()}
    best = {}
    for (shape, cname), w in worst.items():
        if w < worst.get((shape, best.get(shape)), float("inf")):
            best[shape] = cname
    print("graph-timed us per call; ratio = ours/cuBLAS (target <= 1.30); par/seq: both schedules")
    print(f"{'shape':8s} {'config':11s} {'M':>5s} {'sched':5s} {'ours':>8s} {'cuBLAS':>8s} {'ratio':>6s} "
          f"{'par':>8s} {'seq':>8s} {'TB/s':>5s} {'TFLOP/s':>7s} {'roof%':>5s} inv  relerr  same")
    for r in rows:
        if sweep and r["config_name"] not in ("table", best.get(r["shape"])):
            continue
        print(f"{r['shape']:8s} {r['config_name']:11s} {r['M']:5d} {r['schedule']:5s} {r['ours_us']:8.1f} "
              f"{r['cublas_us']:8.1f} {r['ratio']:6.2f} {r.get('par_us', float('nan')):8.1f} "
              f"{r.get('seq_us', float('nan')):8.1f} {r['tbps']:5.2f} {r['tflops']:7.1f} "
              f"{100 * r['roofline_us'] / r['ours_us']:5.0f} {'yes' if r['invariant'] else 'NO '} "
              f"{r['rel_err']:.1e} {r['same_bits_as_reference']}")
    for r in norm_rows:
        print(f"{r['op']:13s} M={r['M']:5d} ours {r['ours_us']:8.1f} torch {r['torch_us']:8.1f} "
              f"ratio {r['ratio']:.2f} inv {'yes' if r['invariant'] else 'NO'}")
    if sweep:
        print("per config: ratio at each M ('!' = not invariant), worst ratio, same bits as the first config of its split_k")
        for (shape, cname), rs in by_cfg.items():
            ratios = " ".join(f"{r['M']}:{r['ratio']:.2f}{'' if r['invariant'] else '!'}" for r in rs)
            print(f"{shape:8s} {cname:11s} {ratios}"
                  + f"  worst {worst[(shape, cname)]:.2f} same {rs[0]['same_bits_as_reference']}"
                  + ("  <- best" if best.get(shape) == cname else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="?", const="all", default=None,
                   help="sweep candidate configs (all, or a comma list of names)")
    p.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    p.add_argument("--ms", default=None, help="comma list of M (default 1,8,64,256,4096)")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--no-norms", action="store_true")
    p.add_argument("--base-split0", action="store_true",
                   help="table configs without split-K; --configs then sweeps the 'ladder' tiles")
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = p.parse_args()
    device, l2 = setup(args)
    args.sweep = args.configs is not None
    args.candidates = None if args.configs in (None, "all") else set(args.configs.split(","))
    args.ms = [int(m) for m in args.ms.split(",")] if args.ms else list(MS)
    import triton

    print(f"{device} torch={torch.__version__} triton={triton.__version__}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    t0 = time.time()
    rows, norm_rows = [], []
    for name in (args.shapes.split(",") if args.shapes else list(SHAPES)):
        rows += bench_shape(name, args, l2, gen)
        save(device, rows, norm_rows)  # after every shape: a run cut short still leaves its numbers
    norm_rows = [] if args.no_norms else bench_norms(args)
    print(f"\ntotal {time.time() - t0:.0f}s")
    print_tables(rows, norm_rows, args.sweep)
    save(device, rows, norm_rows, announce=True)


def save(device, rows, norm_rows, announce: bool = False) -> None:
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bi_matmul.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(device=device, matmul=rows, norms=norm_rows), indent=1))
        if announce:
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
