"""Every device launch of one batch-1 decode step, counted on the CPU (issue 25's bs-1 latency).

The batch-1 decode graph is a string of small kernels whose count, more than their bytes, sets its
time (0.6B on the H200: ~1.1 ms for ~0.31 ms of weight reads). This runs a bf16 model of a
preset's shape (default: Qwen3-0.6B's widths, 2 layers) through the engine with the Triton
attention backend and the fused kernels under Triton's CPU interpreter, and counts, for the one
decode step: each Triton launch (by kernel) and each torch op that is not a view (`.to` is not
counted: a same-dtype one launches nothing, a conversion one kernel). On CUDA the first layer's
torch RMSNorm (pow, mean, add, rsqrt, mul) is the one-launch Triton norm; the rest is what the
graph captures (the eager path adds the logits' row index). TANDEM_PDL=wide shows qkv and gate_up
on the small-M kernel. Usage:

    python scripts/decode_launch_census.py [--preset qwen3-0.6b] [--layers 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# no kernel of their own: views, allocations, metadata (a same-dtype .to/.float returns its input)
NOT_LAUNCHES = {"view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "t", "transpose", "permute",
                "expand", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "empty", "empty_strided",
                "empty_like", "lift_fresh", "unbind", "reshape", "contiguous", "new_empty", "new_empty_strided",
                "to", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride"}


def census(preset: str, layers: int) -> tuple[collections.Counter, int]:
    from triton.runtime.interpreter import InterpretedFunction

    from engine import Engine
    from engine.models import layers as layer_mod
    from engine.runner.model_runner import ModelRunner
    from engine.testing import tiny_model

    shape = dict(tiny_model.PRESETS[preset], num_hidden_layers=layers)
    tiny_model.PRESETS["census"] = shape
    path = tiny_model.build_tiny_model(Path(tempfile.mkdtemp()) / "m", preset="census")
    layer_mod.use_fused_kernels = lambda x: True
    counts: collections.Counter = collections.Counter()
    counting = [False]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if counting[0] and name not in NOT_LAUNCHES:
                counts["torch " + name] += 1
            return func(*args, **(kwargs or {}))

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        was = counting[0]
        if was:
            counts["triton " + self.fn.__name__] += 1
        counting[0] = False  # the interpreter's own tensor traffic is not the device's
        try:
            return run(self, *args, **kwargs)
        finally:
            counting[0] = was

    logits = ModelRunner._logits

    def counted_logits(self, fb, plan):
        if not (fb.forward_mode.is_decode and fb.batch_size == 1):
            return logits(self, fb, plan)
        counting[0] = True
        try:
            with Ops():
                return logits(self, fb, plan)
        finally:
            counting[0] = False

    InterpretedFunction.run, ModelRunner._logits = counted_run, counted_logits
    eng = Engine(model_path=str(path), device="cpu", dtype="bfloat16", load_format="dummy",
                 attention_backend="triton", disable_cuda_graph=True, max_total_tokens=4096)
    try:
        eng.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 2, "temperature": 0.0,
                                                              "ignore_eos": True})
    finally:
        eng.shutdown()
    return counts, layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    counts, layers = census(args.preset, args.layers)
    print(f"{args.preset} shape, {layers} layers: {sum(counts.values())} launches in one batch-1 decode step")
    for name, n in counts.most_common():
        print(f"{n:5d}  {n / layers:5.2f} per layer  {name}")


if __name__ == "__main__":
    main()
