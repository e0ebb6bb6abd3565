"""Where does device memory go over release/update/resume cycles? (issue 11 diagnosis, GPU)

Runs the colocated cycle N times per tag set on the tiny model (float32, CUDA graphs up to bs 8)
and prints per cycle: device used (mem_get_info), torch allocated and reserved, live CUDA graphs.
Usage: python scripts/memory_cycles_probe.py [--cycles 30]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def live_graphs() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph))


def live_blocks() -> dict:
    """(size, where it was allocated) -> count, over the allocator's live blocks (history on)."""
    out: dict = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']}" for f in blk.get("frames", [])
                      if "torch/" not in f["filename"] or "cuda/graphs" in f["filename"]][:3]
            key = (blk["size"], " < ".join(frames))
            out[key] = out.get(key, 0) + 1
    return out


def print_new_blocks(before: dict, after: dict) -> None:
    grown = sorted(((k, after[k] - before.get(k, 0)) for k in after if after[k] > before.get(k, 0)),
                   key=lambda kv: -kv[0][0] * kv[1])
    print(f"  live blocks new since cycle 1: {sum(k[0] * n for k, n in grown) / 2**20:.1f} MB in "
          f"{sum(n for _, n in grown)} blocks", flush=True)
    for (size, where), n in grown[:8]:
        print(f"    +{n} x {size / 2**20:.2f} MB  {where}", flush=True)


def cycles(eng, named, tags, n) -> list[dict]:
    rows = []
    before = None
    for i in range(n):
        assert eng.release_memory_occupation(tags)[0]
        if "weights" in tags:
            assert eng.resume_memory_occupation(["weights"])[0]
            assert eng.update_weights_from_tensor(named, weight_version=str(i))[0]
        rest = [t for t in tags if t != "weights"]
        assert eng.resume_memory_occupation(rest)[0]
        eng.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
        rows.append({"used_mb": used() / 2**20, "alloc_mb": torch.cuda.memory_allocated() / 2**20,
                     "reserved_mb": torch.cuda.memory_reserved() / 2**20, "graphs": live_graphs()})
        if i == 0:
            before = live_blocks()
    print_new_blocks(before, live_blocks())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from safetensors.torch import load_file

    from engine import Engine
    from engine.models.loader import safetensors_files
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    named = [(n, t.cuda()) for p in safetensors_files(path) for n, t in load_file(p).items()]
    eng = Engine(model_path=path, device="cuda", dtype="float32", cuda_graph_max_bs=8,
                 enable_memory_saver=True, max_total_tokens=65536)
    report = {}
    try:
        eng.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
        torch.cuda.memory._record_memory_history(max_entries=200_000)  # frames of live blocks
        for name, tags in (("weights+kv", ["weights", "kv_cache"]), ("cuda_graph", ["cuda_graph"]),
                           ("all", ["weights", "kv_cache", "cuda_graph"]),
                           ("weights+kv again", ["weights", "kv_cache"])):
            rows = cycles(eng, named, tags, args.cycles)
            first, last = rows[0], rows[-1]
            per = {k: (last[k] - first[k]) / max(len(rows) - 1, 1) for k in ("used_mb", "alloc_mb", "reserved_mb")}
            print(f"{name:18s} used {first['used_mb']:.1f}->{last['used_mb']:.1f} MB  alloc {first['alloc_mb']:.1f}->"
                  f"{last['alloc_mb']:.1f}  reserved {first['reserved_mb']:.1f}->{last['reserved_mb']:.1f}  graphs "
                  f"{first['graphs']}->{last['graphs']}  per cycle {per}", flush=True)
            report[name] = rows
    finally:
        eng.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
