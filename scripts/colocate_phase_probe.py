"""Where a colocated release / resume spends its time, at the qwen3_gpu recipe's engine (GPU).

An engine of the recipe's shape (Qwen3-0.6B, bf16, random weights, memory saver, CUDA graphs up to
the rollout batch) with a CPU backup of its weights, so greedy tokens after each cycle must equal
those before it: the graphs, never re-captured, replay on memory mapped back in place. Prints each
cycle's release / resume times and the engine's own per-phase log lines.
Usage: python scripts/colocate_phase_probe.py [--preset qwen3-0.6b] [--cycles 5]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

ALL = ["weights", "kv_cache", "cuda_graph"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine import Engine
    from engine.testing.tiny_model import tiny_model_path

    eng = Engine(model_path=str(tiny_model_path(preset=args.preset)), load_format="dummy", dtype="bfloat16",
                 device="cuda", mem_fraction_static=0.35, enable_memory_saver=True,
                 enable_weights_cpu_backup=True, cuda_graph_max_bs=args.batch, skip_tokenizer_init=True,
                 log_level="info")
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(64)] for i in range(args.batch)]
    greedy = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    try:
        expected = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
        for i in range(args.cycles):
            used = torch.cuda.mem_get_info()
            t0 = time.perf_counter()
            assert eng.release_memory_occupation(ALL)[0]
            t1 = time.perf_counter()
            freed = (torch.cuda.mem_get_info()[0] - used[0]) / 2**30
            assert eng.resume_memory_occupation(["weights"])[0]
            t2 = time.perf_counter()
            assert eng.resume_memory_occupation(["kv_cache", "cuda_graph"])[0]
            t3 = time.perf_counter()
            got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=greedy)]
            t4 = time.perf_counter()
            print(f"cycle {i}: release {t1 - t0:.3f} s (freed {freed:.2f} GiB), resume weights {t2 - t1:.3f} s, "
                  f"resume kv + graphs {t3 - t2:.3f} s, generate {t4 - t3:.3f} s, tokens equal: {got == expected}",
                  flush=True)
            assert got == expected
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
