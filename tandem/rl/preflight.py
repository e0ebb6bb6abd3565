"""preflight: everything about a recipe and its run folder that can be checked before anything
starts (a trainer, Ray, engine actors), so a bad value is a ValueError naming the field, not an
engine actor's traceback minutes later, and a refused run leaves no folder behind.

It also loads the plug-ins (task, reward, rollout_fn) once: the loop uses what it returns.
"""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from recipes.recipe import Recipe
from rollout.plugins import check_arity, load_object
from rollout.tasks import draw_problems, load_task


@dataclass(frozen=True)
class Plugins:
    task: Any
    reward_fn: Callable
    rollout_fn: Optional[Callable]


def preflight(recipe: Recipe, output_dir: Path) -> Plugins:
    check_recipe(recipe)
    plugins = load_plugins(recipe)
    check_output_dir(output_dir)
    return plugins


def check_recipe(recipe: Recipe) -> None:
    """The choices are known ones, the device exists, engine_args are ServerArgs fields."""
    from engine.config import ServerArgs
    from tandem.rl.weight_push import RECIPE_TRANSPORTS
    from trainer_bridge.losses import AGGREGATIONS

    if recipe.off_policy and recipe.colocate:
        raise ValueError("off_policy needs engines generating while the trainer steps; colocate releases them then")
    if recipe.aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {recipe.aggregation!r}")
    if recipe.transport not in RECIPE_TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(RECIPE_TRANSPORTS)}; got {recipe.transport!r}")
    check_device(recipe)
    if not isinstance(getattr(torch, recipe.dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, ...); got {recipe.dtype!r}")
    kwargs = {"model_path": recipe.model, "dtype": recipe.dtype, "device": recipe.device,
              "enable_deterministic_inference": recipe.deterministic}  # as tandem.rl.engines passes them
    try:
        ServerArgs.from_kwargs(**{**kwargs, **recipe.engine_args})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"engine_args: {exc}") from None
    check_attention(recipe)


def check_attention(recipe: Recipe) -> None:
    """The trainer's Policy runs the engine's attention backend (its logprobs must match), so only
    backends it has a packed twin of; Triton on the CPU only under its interpreter (the engine
    would abort every request with that error, and the step would find no response to train)."""
    from engine.attention.registry import deterministic_backends

    backend = recipe.engine_args.get("attention_backend")
    if backend is None:
        return
    if backend not in deterministic_backends():
        raise ValueError(f"engine_args: attention_backend {backend!r}: the trainer recomputes the rollout "
                         f"logprobs with {' or '.join(deterministic_backends())} attention only")
    if backend == "triton" and recipe.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("engine_args: attention_backend 'triton' on the CPU needs TRITON_INTERPRET=1 (Triton's "
                         "interpreter, slow); leave it out to use torch attention there")


def check_device(recipe: Recipe) -> None:
    """A CUDA device this torch can use (a CPU build, or no GPU visible, is named with what to
    run instead); DeepSpeed only on CUDA, with ZeRO-2 or 3."""
    try:
        device = torch.device(recipe.device)
    except RuntimeError:
        raise ValueError(f"device {recipe.device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {recipe.device!r}: tandem train runs on cpu or cuda")
    if recipe.trainer == "deepspeed" and device.type != "cuda":
        raise ValueError("trainer 'deepspeed' runs on CUDA GPUs: on the CPU use --trainer torch")
    if recipe.trainer == "deepspeed" and recipe.zero_stage not in (2, 3):
        raise ValueError(f"trainer 'deepspeed' runs ZeRO stage 2 or 3, got zero_stage {recipe.zero_stage}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"device {recipe.device!r} needs a CUDA GPU, but {why}: run with --device cpu "
                             f"(and --trainer torch)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {recipe.device!r}: only {torch.cuda.device_count()} GPU(s) are visible")


def load_plugins(recipe: Recipe) -> Plugins:
    """Imports the task, reward and rollout_fn, builds the task from task_args and draws one
    problem from it: a bad path, argument or task is refused here."""
    task = load_task(recipe.task, recipe.task_args)
    draw_problems(task, random.Random("preflight"), recipe.prompts_per_step, recipe.task)
    reward_fn = load_object(recipe.reward, "reward")
    check_arity(reward_fn, "reward", recipe.reward, "the Sample")
    rollout_fn = None
    if recipe.rollout_fn:
        rollout_fn = load_object(recipe.rollout_fn, "rollout_fn")
        check_arity(rollout_fn, "rollout_fn", recipe.rollout_fn, "the TurnContext")
        if not (inspect.iscoroutinefunction(rollout_fn) or inspect.iscoroutinefunction(
                getattr(rollout_fn, "__call__", None))):
            raise ValueError(f"rollout_fn {recipe.rollout_fn!r} must be an async function: "
                             f"`async def fn(ctx) -> Sample` (recipes/multi_turn.py)")
    return Plugins(task, reward_fn, rollout_fn)


def check_output_dir(path: Path) -> None:
    """A run folder that does not exist yet (it is created, parents too) or is empty: a previous
    run's metrics.jsonl and checkpoint/ are never mixed with or overwritten by this one."""
    if path.is_file():
        raise ValueError(f"--output-dir {path} is a file, not a folder: pass a new folder's path")
    if path.is_dir():
        contents = sorted(p.name for p in path.iterdir())
        if contents:
            shown = ", ".join(contents[:3]) + (", ..." if len(contents) > 3 else "")
            raise ValueError(f"--output-dir {path} is not empty ({shown}): pass a new folder, or remove "
                             f"this one to run there again")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--output-dir {path}: this user cannot write there; pass a writable folder")
        return
    existing = next((p for p in path.absolute().parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"--output-dir {path}: {existing} is a file (Not a directory); pass a folder path")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {path}: this user cannot create folders in {existing}; pass a writable "
                         f"path")
