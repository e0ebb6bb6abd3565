"""Time fused_moe (one MoE layer) at the Qwen3-30B-A3B shape on the GPU, normal and deterministic mode.

Decode sizes replay a CUDA graph (as the engine runs them), prefill sizes run eagerly. Reported
against the H200's roofline: bytes = expert weights actually touched (unique experts x 3*H*I*2)
+ activations in and out; FLOPs = 2 * T * K * 3*H*I. Medians of triton.testing.do_bench over a
call of LAYERS layers with their own weights (4.8 GB, so no layer's weights stay in the 50 MB L2),
divided by LAYERS.
Usage: python scripts/fused_moe_bench.py [--ts 1,8,64,256,4096,16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

H, I, E, K = 2048, 768, 128, 8
PEAK_BYTES, PEAK_FLOPS = 3.8e12, 790e12  # H200: HBM3e bandwidth, dense bf16 tensor cores
GRAPH_MAX_T = 256
LAYERS = 4


def _inputs(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(K, -1)
    return hidden, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def _timed(fn, graph: bool) -> float:
    import triton

    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def bench_one(T: int, deterministic: bool, layers) -> dict:
    from engine.kernels.fused_moe import fused_moe

    hidden, w, ids = _inputs(T, seed=T)

    def step():
        for w13, w2 in layers:
            fused_moe(hidden, w13, w2, w, ids, deterministic=deterministic)

    ms = _timed(step, T <= GRAPH_MAX_T) / len(layers)
    experts = int(ids.unique().numel())
    nbytes = experts * 3 * H * I * 2 + 2 * T * H * 2 + T * K * 8
    flops = 2 * T * K * 3 * H * I
    sec = ms / 1e3
    return {"T": T, "deterministic": deterministic, "graph": T <= GRAPH_MAX_T, "ms": round(ms, 4),
            "unique_experts": experts, "GB_per_s": round(nbytes / sec / 1e9, 1),
            "pct_bw": round(100 * nbytes / sec / PEAK_BYTES, 1), "TFLOP_per_s": round(flops / sec / 1e12, 1),
            "pct_flops": round(100 * flops / sec / PEAK_FLOPS, 1),
            "roofline_ms": round(1e3 * max(nbytes / PEAK_BYTES, flops / PEAK_FLOPS), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="1,8,64,256,4096,16384", help="token counts, comma separated")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [((torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).bfloat16(),
               (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).bfloat16()) for _ in range(LAYERS)]
    rows = [bench_one(int(t), det, layers) for t in args.ts.split(",") for det in (False, True)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": {"H": H, "I": I, "E": E, "K": K, "dtype": "bfloat16"},
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"{'T':>6} {'mode':>5} {'ms':>8} {'roof ms':>8} {'experts':>7} {'GB/s':>7} {'%bw':>5} {'TF/s':>6} {'%fl':>5}")
    for r in rows:
        print(f"{r['T']:>6} {'det' if r['deterministic'] else 'norm':>5} {r['ms']:>8.4f} {r['roofline_ms']:>8.4f} "
              f"{r['unique_experts']:>7} {r['GB_per_s']:>7.1f} {r['pct_bw']:>5.1f} {r['TFLOP_per_s']:>6.1f} {r['pct_flops']:>5.1f}")


if __name__ == "__main__":
    main()
