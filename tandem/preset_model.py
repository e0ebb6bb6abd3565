"""`--preset` or `--model-path`: the engine kwargs a command-line tool runs with.

Shared by `tandem bench`, `tandem determinism` and `tandem replay`. A preset builds (once, then
reuses) a checkpoint with `tandem tiny-model`; the real-shape presets ship config + tokenizer
only, so they imply `--load-format dummy`.
"""

from __future__ import annotations

import argparse
from typing import Any

PRESETS = ("tiny", "tiny-moe", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")


def add_preset_argument(group: Any) -> None:
    group.add_argument("--preset", choices=PRESETS, default=None,
                       help="build the checkpoint with `tandem tiny-model` (real shapes imply "
                       "--load-format dummy); the default when --model-path is not given: tiny")


def engine_kwargs_from_args(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
    """-> (Engine kwargs from the ServerArgs flags on args, a label for the model)."""
    from tandem.server_args import server_args_from_namespace

    kwargs = server_args_from_namespace(args)
    preset = getattr(args, "preset", None)
    if "model_path" in kwargs:
        if preset:
            raise SystemExit(f"tandem {command}: give --model-path or --preset, not both")
        return kwargs, kwargs["model_path"]
    from engine.testing.tiny_model import tiny_model_path

    preset = preset or "tiny"
    kwargs["model_path"] = str(tiny_model_path(preset=preset))
    if not preset.startswith("tiny") and kwargs.get("load_format", "auto") == "auto":
        kwargs["load_format"] = "dummy"  # real-shape presets ship config + tokenizer only
    return kwargs, f"{preset} preset"
