"""Where a decode step's time goes: the host's work or the device's, per step, at a batch size.

Runs N requests of (input, output) tokens through an in-process Engine (final results only) and
times, on the core's thread, every `EngineCore.step` and the part of it spent waiting for the
device (`PendingResult.resolve`'s event wait). A step that waits is device bound (the host was
ahead); a step that does not is host bound. Also replays the captured CUDA graph of the batch
size alone (no host work between replays) for the device's time per step.

    python scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 [--bs 256] [--engine-args JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def instrument():
    """Patch EngineCore.step and PendingResult.resolve's wait; -> the lists they fill."""
    from engine.core.engine_core import EngineCore
    from engine.runner.pending_result import PendingResult

    steps, waits = [], []
    step, resolve = EngineCore.step, PendingResult.resolve

    def timed_step(self):
        t0 = time.perf_counter()
        out = step(self)
        steps.append(time.perf_counter() - t0)
        return out

    def timed_resolve(self):
        if self.event is not None:
            t0 = time.perf_counter()
            self.event.synchronize()
            waits.append(time.perf_counter() - t0)
        return resolve(self)

    EngineCore.step, PendingResult.resolve = timed_step, timed_resolve
    return steps, waits


def graph_replay_ms(engine, bs: int, reps: int = 50) -> float:
    """The device's time of one decode step of bs rows: the captured graph replayed back to back."""
    graphs = engine.local_core.parts.runner.cuda_graph
    graph = getattr(graphs, "graphs", {}).get(bs) if graphs is not None else None
    if graph is None:
        return float("nan")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--bs", type=int, action="append")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--engine-args", default="{}")
    args = p.parse_args()
    steps, wait_list = instrument()
    from engine import Engine
    from engine.testing.tiny_model import tiny_model_path

    eng = Engine(model_path=str(tiny_model_path(preset=args.preset)), load_format="dummy",
                 skip_tokenizer_init=True, **json.loads(args.engine_args))
    try:
        for bs in args.bs or [1]:
            prompts = [[(7 * i + j) % 1000 + 3 for j in range(args.input_len)] for i in range(bs)]
            params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
            eng.generate(input_ids=prompts, sampling_params=params)  # warm-up
            steps.clear(), wait_list.clear()
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - t0
            busy = sorted(steps)[len(steps) // 10:]  # the idle polls between requests are the shortest
            waits = wait_list or [0.0]  # the CPU: no device event to wait on
            print(f"bs {bs}: {wall / args.output_len * 1e3:.3f} ms a token; {len(steps)} steps, median "
                  f"{statistics.median(busy) * 1e3:.3f} ms; device wait per step median "
                  f"{statistics.median(waits) * 1e3:.3f} ms (mean {statistics.mean(waits) * 1e3:.3f}); "
                  f"host = step - wait ~ {(statistics.median(busy) - statistics.median(waits)) * 1e3:.3f} ms; "
                  f"graph replay alone {graph_replay_ms(eng, bs):.3f} ms", flush=True)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
