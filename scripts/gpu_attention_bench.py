"""Benchmark the triton attention backend on one CUDA GPU at the Qwen3-8B attention shape
(32 q heads, 8 kv heads, head_dim 128, bf16), normal vs deterministic mode.

Decode at bs 1/32/256 x context 768/4096: time per layer call (KV store + attention), achieved
GB/s over the K+V bytes of all sequences (the floor: bs * ctx * 8 * 128 * 2 B * 2 per layer),
and its share of the measured copy bandwidth. Timed as CUDA-graph replays of L layer calls, as the
engine decodes (and eagerly, launch overhead included). L layers, each with its own KV, so that
all layers' KV together are >= 3x the L2 and every call reads HBM, as a real model's layers do.
Extend: fresh prefills (8192 tokens per batch) and 256-token chunks over a cached prefix; TFLOP/s
of the causal attention. Deterministic output is checked against normal mode (rel. error).
--sweep also times candidate tile configs (decode, and deterministic for both kinds) at ctx 4096;
--dry-run runs everything on the CPU in Triton's interpreter at tiny sizes (checks the script).

    python scripts/gpu_attention_bench.py [--sweep] [--bs 1,32,256] [--ctx 768,4096] [--dry-run]
Writes $OUT/gpu_attention_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
H, HKV, D = 32, 8, 128
L2_BYTES = 50 * 2**20
SWEEP = [(16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 4, 3), (16, 32, 4, 3), (32, 64, 4, 2),
         (32, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (16, 128, 4, 3), (16, 64, 4, 4),
         (16, 32, 4, 4)]  # block_m, block_n, warps, stages


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--bs", default="1,32,256")
    p.add_argument("--ctx", default="768,4096")
    p.add_argument("--layout", choices=["shuffled", "contiguous"], default="shuffled")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args()


class Setup:
    """bs sequences of ctx tokens in a pool of `layers` layers; decode and extend batches."""

    def __init__(self, bs: int, ctx: int, layout: str, dev: str, dtype: torch.dtype):
        from engine.kv.pool import KVPool

        self.bs, self.ctx, self.dev, self.dtype = bs, ctx, dev, dtype
        self.kv_bytes = bs * ctx * HKV * D * 2 * 2
        self.layers = min(64, max(1, math.ceil(3 * L2_BYTES / self.kv_bytes)))
        self.pool = KVPool(bs * ctx, self.layers, HKV, D, dtype, dev)
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf.normal_()  # never time zeros
        slots = torch.arange(1, bs * ctx + 1, device=dev)
        if layout == "shuffled":
            slots = slots[torch.randperm(slots.numel(), device=dev)]
        self.r2t = torch.zeros(bs + 1, ctx + 1, dtype=torch.int64, device=dev)
        self.r2t[1:, :ctx] = slots.view(bs, ctx)

    def batch(self, backend, items, decode: bool):
        from engine.forward_batch import ForwardBatch, ForwardMode

        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.dev)  # noqa: E731
        pos = torch.cat([torch.arange(a, a + n, device=self.dev) for _, a, n in items])
        rows = torch.cat([torch.full((n,), s + 1, device=self.dev) for s, _, n in items])
        return ForwardBatch(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND, torch.zeros_like(pos), pos,
            self.r2t[rows, pos], t([s + 1 for s, *_ in items]), t([a + n for _, a, n in items]),
            [a + n for _, a, n in items],
            [a for _, a, _ in items], [n for *_, n in items], self.r2t, self.pool, backend)

    def qkv(self, tokens: int):
        """The same q, k, v for a token count, so both modes see the same inputs."""
        gen = torch.Generator(device=self.dev).manual_seed(tokens)
        r = lambda *s: torch.randn(*s, device=self.dev, generator=gen).to(self.dtype)  # noqa: E731
        return r(tokens, H, D), r(tokens, HKV, D), r(tokens, HKV, D)


def time_ms(fn, reps: int) -> float:
    """Median of reps timed calls (events), after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(dev: str) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = (1 << 30) if dev == "cuda" else (1 << 20)
    src, dst = torch.randn(n // 2, device=dev, dtype=torch.bfloat16), torch.empty(n // 2, device=dev, dtype=torch.bfloat16)
    return 2 * n / (time_ms(lambda: dst.copy_(src), 10) * 1e-3)


def make_backend(det: bool, cfg, split: int = 256):
    from engine.attention.split_kv_plan import KernelConfig
    from engine.attention.triton import TritonAttentionBackend

    if cfg is None:
        return TritonAttentionBackend(deterministic=det, split_size=split)
    kc = KernelConfig(*cfg, fp_fusion=not det)
    keys = ("deterministic", "deterministic_extend") if det else ("decode",)  # det: the tile for both kinds
    return TritonAttentionBackend(deterministic=det, split_size=split, configs=dict.fromkeys(keys, kc))


def bench_decode(s: Setup, det: bool, cfg, args, split: int = 256) -> tuple[dict, torch.Tensor]:
    """split: the fixed split (det) or the shortest decode split (normal)."""
    tb = make_backend(det, cfg, split)
    items = [(i, s.ctx - 1, 1) for i in range(s.bs)]
    fb = s.batch(tb, items, decode=True)
    q, k, v = s.qkv(s.bs)
    scale = D**-0.5
    run = lambda: [tb.forward(q, k, v, layer, scale, fb) for layer in range(s.layers)][-1]  # noqa: E731
    tb.init_forward_metadata(fb)
    out = run()
    eager = time_ms(lambda: (tb.init_forward_metadata(fb), run()), args.reps) / s.layers
    replay = float("nan")
    if torch.cuda.is_available():
        tb.init_cuda_graph_state(s.bs, s.ctx + 1, H, HKV, D, torch.device(s.dev))
        tb.init_forward_metadata_capture(s.bs, fb.req_pool_indices, fb.seq_lens)
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        replay = time_ms(g.replay, args.reps) / s.layers
    best = replay if math.isfinite(replay) else eager
    row = dict(kind="decode", det=det, bs=s.bs, ctx=s.ctx, config=cfg, split=split, lanes=tb.plan.lanes,
               us_graph=replay * 1e3, us_eager=eager * 1e3, gb_s=s.kv_bytes / (best * 1e-3) / 1e9)
    return row, out


def bench_extend(s: Setup, det: bool, cfg, args, chunk: int) -> tuple[dict, torch.Tensor]:
    """chunk 0: fresh prefills of whole sequences, <= 8192 tokens; else `chunk` new tokens over
    a cached prefix of ctx - chunk for every sequence, <= 8192 tokens."""
    tb = make_backend(det, cfg)
    n_new = min(chunk, s.ctx // 2) if chunk else s.ctx
    n_seq = max(1, min(s.bs, 8192 // n_new))
    items = [(i, s.ctx - n_new, n_new) for i in range(n_seq)]
    fb = s.batch(tb, items, decode=False)
    q, k, v = s.qkv(n_seq * n_new)
    scale = D**-0.5
    run = lambda: [tb.forward(q, k, v, layer, scale, fb) for layer in range(s.layers)][-1]  # noqa: E731
    tb.init_forward_metadata(fb)
    out = run()
    ms = time_ms(lambda: (tb.init_forward_metadata(fb), run()), args.reps) / s.layers
    keys = n_seq * sum(s.ctx - n_new + i + 1 for i in range(n_new))  # causal (query, key) pairs
    row = dict(kind="prefill" if not chunk else f"chunk{chunk}", det=det, bs=n_seq, ctx=s.ctx,
               config=cfg, us_eager=ms * 1e3, tflop_s=4 * H * D * keys / (ms * 1e-3) / 1e12)
    return row, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_shape(s: Setup, args) -> list[dict]:
    rows = []
    outs = {}
    # each kind in both modes back to back: extends rewrite pool KV, both modes must see the same
    for fn, extra in ((bench_decode, {}), (bench_extend, {"chunk": 0}), (bench_extend, {"chunk": 256})):
        if fn is bench_extend and s.bs != args.bs_list[-1]:
            continue  # extend does not depend on bs: once per context
        for det in (False, True):
            row, out = fn(s, det, None, args, **extra)
            if det:
                row["rel_err_vs_normal"] = rel(out, outs[row["kind"]])
            outs[row["kind"]] = out
            rows.append(row)
    if args.sweep:
        for split in (64, 128):  # normal mode: shorter decode splits, more programs at small bs
            rows.append(bench_decode(s, False, None, args, split=split)[0])
    if args.sweep and s.ctx == max(args.ctx_list):
        for det in (False, True):
            for cfg in SWEEP:
                rows.append(bench_decode(s, det, cfg, args)[0])
                if det and s.bs == args.bs_list[-1]:
                    rows.append(bench_extend(s, det, cfg, args, chunk=0)[0])
    return rows


def label(row: dict) -> str:
    """Kernel config (block_m, block_n, warps, stages) and a non-default split size."""
    name = str(row["config"] or "default")
    split = row.get("split", 256)
    return name if split == 256 else f"{name} split{split}"


def print_table(rows: list[dict], copy_bw: float) -> None:
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'kind':9} {'mode':6} {'bs':>4} {'ctx':>5} {'config':18} {'lanes':>5} {'us graph':>9} "
          f"{'us eager':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'err':>8}")
    for r in rows:
        gbs = r.get("gb_s")
        print(f"{r['kind']:9} {'det' if r['det'] else 'normal':6} {r['bs']:>4} {r['ctx']:>5} "
              f"{label(r):18} {r.get('lanes', ''):>5} "
              f"{r.get('us_graph', float('nan')):9.1f} {r['us_eager']:9.1f} "
              f"{gbs or float('nan'):7.0f} {100 * (gbs or float('nan')) * 1e9 / copy_bw:6.1f} "
              f"{r.get('tflop_s', float('nan')):8.1f} {r.get('rel_err_vs_normal', float('nan')):8.1e}")


def main() -> None:
    args = parse()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        global H, HKV, D, L2_BYTES
        H, HKV, D, L2_BYTES = 4, 2, 16, 1 << 12
        args.bs, args.ctx, args.reps = "1,3", "40,70", 2
    dev = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    args.bs_list = [int(x) for x in args.bs.split(",")]
    args.ctx_list = [int(x) for x in args.ctx.split(",")]
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(dev)
    rows = []
    for ctx in args.ctx_list:
        for bs in args.bs_list:
            setup = Setup(bs, ctx, args.layout, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
            rows += run_shape(setup, args)
            del setup
            if dev == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    result = dict(device=device, torch=torch.__version__, copy_bw=copy_bw, layout=args.layout,
                  shape=dict(heads=H, kv_heads=HKV, head_dim=D), rows=rows)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_attention_bench.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}")
    print_table(rows, copy_bw)


if __name__ == "__main__":
    main()
