"""Benchmark + check the small-batch decode kernels on one CUDA GPU against what they replace.

small_m_linear vs F.linear (cuBLAS) on the Qwen3-0.6B and Qwen3-8B layer shapes at M in
--ms (1, 2, 4, 8): a sweep of tiles at M = 1 (block_n x block_k x programs per SM), then the
engine's choice and the sweep's best at every M; error vs a float32 reference. greedy_logprob vs the torch
path it replaces (argmax + float32 log_softmax + gather) at B in {1, 32, 256}, V = 151,936: ids
equal, logprob difference, time.

Timing: CUDA graphs of R back-to-back calls, each on its own weight copy (all copies >= 3x the
L2, so weights come from HBM as in a model's step), median of --reps replays / R.

    python scripts/decode_kernels_bench.py [--quick] [--ms 1,8,16,32] [--json PATH]
Writes $OUT/decode_kernels.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import small_m_linear as sml  # noqa: E402
from engine.kernels.greedy_logprob import greedy_logprob  # noqa: E402

SHAPES = {"0.6b_qkv": (4096, 1024), "0.6b_o": (1024, 2048), "0.6b_gate_up": (6144, 1024),
          "0.6b_down": (1024, 3072), "8b_qkv": (6144, 4096), "8b_o": (4096, 4096),
          "8b_gate_up": (24576, 4096), "8b_down": (4096, 12288)}
L2_BYTES = 50 * 2**20


def graph_time_us(fns, reps: int) -> float:
    """Median time of one call, the calls captured back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # compile + warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def bench_linear(args, sms: int) -> list[dict]:
    rows = []
    sweep = [(bn, bk, ps) for bn in (32, 64, 128) for bk in (128, 256) for ps in (1, 2, 4)
             ] if not args.quick else [(64, 128, 1)]
    for name, (n, k) in SHAPES.items():
        copies = max(4, -(-3 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]

        def timed(m, cfg):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if cfg == "cublas":
                return graph_time_us([lambda w=w: F.linear(x, w) for w in ws], args.reps)
            return graph_time_us([lambda w=w: sml.small_m_linear(x, w, None, cfg) for w in ws], args.reps)

        best, best_us = None, float("inf")
        for bn, bk, ps in sweep:  # the engine's rule (choose_config) around its defaults
            cfg = sml.choose_config(n, k, sms, bn, bk, programs_per_sm=ps, min_k_steps=1)
            try:
                us = timed(1, cfg)
            except Exception as exc:  # a tile that does not compile here
                print(f"{name} {cfg}: {type(exc).__name__}: {exc}"[:200])
                continue
            rows.append({"shape": name, "m": 1, "config": cfg.__dict__, "us": us, "sweep": True})
            if us < best_us:
                best, best_us = cfg, us
        default = sml.wide_config(n, sms) if n > k else sml.choose_config(n, k, sms)  # the engine's choice
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            err = (sml.small_m_linear(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
            cub = timed(m, "cublas")
            dflt = timed(m, default)
            bst = timed(m, best) if best is not None else float("nan")
            floor_us = n * k * 2 / 4.0e12 * 1e6
            row = {"shape": name, "m": m, "cublas_us": cub, "default_us": dflt, "best_us": bst,
                   "default": default.__dict__, "best": best.__dict__ if best else None,
                   "rel_err": err, "bandwidth_floor_us": floor_us}
            rows.append(row)
            print(f"{name:>14} M={m}: cuBLAS {cub:7.2f} us | default {dflt:7.2f} | best {bst:7.2f} "
                  f"{best} | floor {floor_us:5.2f} | rel err {err:.1e}", flush=True)
        del ws
    return rows


def bench_greedy(args) -> list[dict]:
    rows = []
    V = 151936
    for B in (1, 32, 256):
        copies = max(2, -(-3 * L2_BYTES // (B * V * 4)))
        logits = [torch.randn(B, V, device="cuda") * 3 for _ in range(copies)]

        def torch_path(x):
            ids = torch.argmax(x, dim=-1)
            return ids, torch.log_softmax(x.float(), dim=-1).gather(1, ids[:, None]).squeeze(1)

        t_ref = graph_time_us([lambda x=x: torch_path(x) for x in logits], args.reps)
        t_new = graph_time_us([lambda x=x: greedy_logprob(x) for x in logits], args.reps)
        ids, lp = greedy_logprob(logits[0])
        ref_ids, ref_lp = torch_path(logits[0])
        row = {"B": B, "torch_us": t_ref, "fused_us": t_new, "ids_equal": bool(torch.equal(ids, ref_ids)),
               "logprob_max_abs_diff": (lp - ref_lp).abs().max().item()}
        rows.append(row)
        print(f"greedy B={B}: torch {t_ref:7.1f} us | fused {t_new:7.1f} us | ids equal {row['ids_equal']} | "
              f"logprob diff {row['logprob_max_abs_diff']:.2e}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the default tile only, no sweep")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8],
                   help="rows of x to time (comma-separated; at most small_m_linear.MAX_M)")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(0), "greedy": bench_greedy(args),
              "linear": bench_linear(args, sms)}
    path = args.json or (os.path.join(os.environ["OUT"], "decode_kernels.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
