"""Where a decode step's time goes: the host's work or the device's, per step, at a batch size.

Runs N requests of (input, output) tokens through an in-process Engine (final results only) and
times, on the core's thread, every `EngineCore.step` and the part of it spent waiting for the
device (`PendingResult.resolve`'s event wait). A step that waits is device bound (the host was
ahead); a step that does not is host bound. Also replays the captured CUDA graph of the batch
size alone (no host work between replays) for the device's time per step.

--host-profile N prints the N functions of the core thread with the most own time over the
measured run (cProfile of every step): where a host-bound step's time goes. --null-forward
replaces the model pass with zero logits (the runner's `_logits`): what is left is the host's
per-step work alone, measurable on the CPU.

    python scripts/step_time_probe.py --preset qwen3-0.6b --bs 1 [--bs 256] [--engine-args JSON]
    python scripts/step_time_probe.py --preset tiny --bs 1 --bs 64 --bs 256 --null-forward --host-profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def instrument(profiler: cProfile.Profile | None = None):
    """Patch EngineCore.step and PendingResult.resolve's wait; -> the lists they fill. With a
    profiler, each step runs under it (it sees the core's thread only)."""
    from engine.core.engine_core import EngineCore
    from engine.runner.pending_result import PendingResult

    steps, waits = [], []
    step, resolve = EngineCore.step, PendingResult.resolve

    def timed_step(self):
        t0 = time.perf_counter()
        if profiler is not None and PROFILING[0]:
            profiler.enable()
            try:
                out = step(self)
            finally:
                profiler.disable()
        else:
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


PROFILING = [False]  # set around the measured run only


def null_forward() -> None:
    """The model pass replaced by zero float32 logits of the rows sampled: the step's host work alone."""
    from engine.runner.model_runner import ModelRunner

    def zero_logits(self, fb, plan):
        return torch.zeros(len(plan.rows), self.config.vocab_size, device=self.device)

    ModelRunner._logits = zero_logits


def top_functions(profiler: cProfile.Profile, n: int, steps: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    print(f"host profile over {steps} steps (cProfile inflates the times; compare shares):", file=out)
    stats.sort_stats("tottime").print_stats(n)
    return out.getvalue()


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
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="print the N core-thread functions with the most own time over the measured run")
    p.add_argument("--null-forward", action="store_true", help="zero logits instead of the model pass")
    args = p.parse_args()
    if args.null_forward:
        null_forward()
    profiler = cProfile.Profile() if args.host_profile else None
    steps, wait_list = instrument(profiler)
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
            if profiler is not None:  # a run of its own: the timed one above stays unprofiled
                PROFILING[0], before = True, len(steps)
                eng.generate(input_ids=prompts, sampling_params=params)
                PROFILING[0] = False
                print(top_functions(profiler, args.host_profile, len(steps) - before), flush=True)
                profiler.clear()
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
