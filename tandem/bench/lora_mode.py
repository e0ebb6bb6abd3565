"""`tandem bench --lora-adapters N`: the same workload with every request on a LoRA adapter.

N random adapters in PEFT's format (engine/testing/random_lora.py: the model's shapes, from its
config, so real-shape presets with dummy weights work; lora_B non-zero, so each delta is real) are
written to a temporary directory and loaded at start-up (--lora-paths); requests take them round-
robin (N = 1: all on the one adapter), which makes a batch mix all N. --max-loras-per-batch is
raised to N + 1 if lower (the base model counts as one, so every adapter fits one batch), and
--max-lora-rank to the rank if unset. What the adapters target is --lora-target-modules (default:
all seven linears). The result's "lora" records these settings.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from engine.lora.lora_config import LORA_TARGETS, expand_targets


def add_lora_arguments(group: Any) -> None:
    group.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                       help="serve N random LoRA adapters of the model's shapes and spread the requests "
                       "over them round-robin (0: the base model alone)")
    group.add_argument("--lora-rank", type=int, default=16, metavar="R",
                       help="the adapters' rank; they target --lora-target-modules (default: all linears)")


@dataclass
class LoRABench:
    names: list[str]
    rank: int
    target_modules: list[str]
    max_loras_per_batch: int
    scratch: Any  # the TemporaryDirectory holding the adapters (kept while a served engine may load them)

    def request_adapters(self, num_requests: int) -> list[str]:
        """Round-robin over the adapters: request i takes adapter i mod N."""
        return [self.names[i % len(self.names)] for i in range(num_requests)]

    def describe(self) -> dict[str, Any]:
        return {"adapters": len(self.names), "rank": self.rank, "target_modules": self.target_modules,
                "max_loras_per_batch": self.max_loras_per_batch, "assignment": "round-robin"}

    def cleanup(self) -> None:
        self.scratch.cleanup()


def check_lora_flags(args: argparse.Namespace) -> None:
    if args.lora_adapters < 0 or args.lora_rank < 1:
        raise SystemExit("tandem bench: --lora-adapters must be >= 0 and --lora-rank >= 1")
    if not args.lora_adapters:
        return
    clash = [flag for flag, on in (("--url", args.url), ("--compare-hf", args.compare_hf),
                                   ("--lora-paths", bool(args.lora_paths))) if on]
    if clash:
        raise SystemExit(f"tandem bench: --lora-adapters builds and loads its own adapters in the engine it "
                         f"starts; drop {clash[0]} (the HF baseline runs the base model only)")
    if args.max_lora_rank is not None and args.max_lora_rank < args.lora_rank:
        raise SystemExit(f"tandem bench: --lora-rank {args.lora_rank} exceeds --max-lora-rank {args.max_lora_rank}")


def prepare_lora(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Optional[LoRABench]:
    """Writes the adapters and sets the engine's LoRA flags in engine_kwargs; None when N = 0."""
    import torch

    from engine.testing.random_lora import write_random_adapters

    if not args.lora_adapters:
        return None
    targets = expand_targets(list(args.lora_target_modules or LORA_TARGETS))
    scratch = tempfile.TemporaryDirectory(prefix="tandem-bench-lora-")
    dtype = torch.float32 if engine_kwargs.get("dtype") == "float32" else torch.bfloat16
    dirs = write_random_adapters(engine_kwargs["model_path"], scratch.name, args.lora_adapters, args.lora_rank,
                                 target_modules=targets, seed=args.seed, dtype=dtype)
    names = [d.name for d in dirs]
    targets = json.loads((dirs[0] / "adapter_config.json").read_text())["target_modules"]  # a MoE's dense ones
    per_batch = max(engine_kwargs.get("max_loras_per_batch") or 1, len(names) + 1)
    engine_kwargs.update(enable_lora=True, lora_paths=tuple(f"{n}={d}" for n, d in zip(names, dirs)),
                         max_loras_per_batch=per_batch,
                         max_lora_rank=engine_kwargs.get("max_lora_rank") or args.lora_rank)
    return LoRABench(names, args.lora_rank, targets, per_batch, scratch)
