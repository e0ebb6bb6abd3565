"""Host-side cost of one decode step at a given batch size, with the model stubbed out.

The GPU runs the model; everything else in a step (scheduling, batch tensors, sampling setup,
bookkeeping) is CPU time that shows up between GPU steps unless overlapped. This measures it.
    python scripts/cpu_step_overhead.py --bs 256 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from engine.core.engine_core import EngineCore
    from engine.config import ServerArgs
    from engine.core.messages import ReqInput
    from engine.sampling_params import SamplingParams
    from engine.testing.tiny_model import tiny_model_path

    core = EngineCore(ServerArgs(model_path=str(tiny_model_path()), device="cpu", dtype="float32",
                                 skip_tokenizer_init=True))
    model = core.runner.model
    hidden = model.config.hidden_size
    vocab = core.parts.vocab_size
    model.forward = lambda input_ids, positions, fb: torch.zeros(input_ids.shape[0], hidden)
    model.compute_logits = lambda h: torch.randn(h.shape[0], vocab)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=args.steps + 10, ignore_eos=True, temperature=0.0)
    for i in range(args.bs):
        ids = [rng.randrange(3, vocab) for _ in range(64)]
        core.handle(ReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i))
    while core.scheduler.waiting:
        core.step()
    prof = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(args.steps):
        core.step()
    if prof:
        prof.disable()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"bs={args.bs}: {per_step * 1e3:.2f} ms host time per decode step (model stubbed)")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
