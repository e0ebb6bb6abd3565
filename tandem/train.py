"""`tandem train`: run an RL recipe (the embedded default when none is named).

Every field of recipes.recipe.Recipe is a flag (`--steps 2`, `--lr 1e-3`, `--off-policy true`,
`--engine-args '{"mem_fraction_static": 0.5}'`); recipes are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from recipes.recipe import Recipe

    parser.add_argument("--recipe", default="default",
                        help="a recipe name (recipes/<name>.py: default, lora, tool_use, qwen3_gpu), a .py file "
                        "defining RECIPE, or a .yaml/.json file of fields")
    parser.add_argument("--output-dir", default=None, help="the run folder (default: a fresh one under ./runs/)")
    parser.add_argument("--quiet", action="store_true", help="no console table or progress bar")
    group = parser.add_argument_group("recipe overrides (each replaces the recipe's field)")
    for f in dataclasses.fields(Recipe):
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"override_{f.name}", default=None, metavar="V",
                           help=f"(recipe field {f.name})")


def run_train(args: argparse.Namespace) -> int:
    from tandem.rl.loop import run
    from recipes.recipe import load_recipe, with_overrides

    try:
        recipe = load_recipe(args.recipe)
        overrides = {k.removeprefix("override_"): v for k, v in vars(args).items()
                     if k.startswith("override_") and v is not None}
        recipe = with_overrides(recipe, overrides)
    except ValueError as exc:
        raise SystemExit(f"tandem train: {exc}") from None
    output_dir = Path(args.output_dir) if args.output_dir else _fresh_run_dir(recipe.name)
    start = time.perf_counter()
    result = run(recipe, output_dir, quiet=args.quiet)
    last = result.metrics[-1] if result.metrics else {}
    print(f"done in {time.perf_counter() - start:.0f}s: reward {result.metrics[0]['reward_mean']:.3f} (step 1) -> "
          f"{last.get('reward_mean', float('nan')):.3f} (step {last.get('step')})" if result.metrics else "done")
    print(f"run folder: {result.output_dir}  (metrics.jsonl"
          + (", reward_curve.png" if result.reward_curve else "") + (", checkpoint/" if result.checkpoint else "") + ")")
    adapter_config = result.checkpoint / "adapter_config.json" if result.checkpoint else None
    if adapter_config and adapter_config.exists():
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        print(f"LoRA adapter (PEFT format): {result.checkpoint}  (tandem serve --model-path {base} "
              f"--lora-paths policy={result.checkpoint})")
    elif result.checkpoint:
        print(f"checkpoint: {result.checkpoint}  (tandem serve --model-path {result.checkpoint})")
    return 0


def _fresh_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{name}-{stamp}"
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path("runs") / f"{name}-{stamp}-{suffix}"
    return path
