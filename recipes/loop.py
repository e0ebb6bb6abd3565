"""The GRPO loop of `tandem train`: rollouts -> rewards -> advantages -> update -> weight push.

Step k generates its groups on the engines (weight version k-1), computes GRPO advantages per
group, takes one optimizer step with the clipped objective and TIS on the rollout logprobs, and
pushes the new weights (version k) to every engine. With `off_policy`, step k+1's rollouts are
generated on version k-1 while step k trains, and TIS corrects the one-step lag. The warm start
(supervised) runs first and its weights are pushed as version 0.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from recipes.engines import EnginePool
from recipes.model_source import ModelSource
from rollout.plugins import load_object
from recipes.recipe import Recipe
from recipes.report import RunReport
from recipes.rollouts import RolloutResult, Rollouts
from recipes.trainer_setup import build_trainer
from recipes.warm_start import warm_start
from recipes.weight_push import WeightPusher
from trainer_bridge.losses import group_advantages
from trainer_bridge.rollout_batch import RolloutBatch


@dataclass
class RunResult:
    output_dir: Path
    metrics: list[dict]
    checkpoint: Optional[Path]
    reward_curve: Optional[Path]
    samples: list[list[Any]]  # the last step's groups (tests read their versions and masks)


def plan_line(recipe: Recipe, source: ModelSource, output_dir: Path) -> str:
    engines = f"{recipe.num_engines} {'Ray engine actors' if recipe.engine_backend == 'ray' else 'in-process engines'}"
    warm = f"{recipe.warm_start_steps} warm-start steps, then " if recipe.warm_start_steps else ""
    return (f"tandem train [{recipe.name}]: {source.label} on {recipe.device}; {warm}{recipe.steps} GRPO steps x "
            f"{recipe.prompts_per_step} prompts x {recipe.n_per_prompt} samples of {recipe.task.split(':')[-1]}; "
            f"{engines}, {recipe.trainer} trainer, deterministic={recipe.deterministic}, "
            f"{'one-step off-policy' if recipe.off_policy else 'on-policy'}; run folder {output_dir}")


def check_recipe(recipe: Recipe) -> None:
    """What can be checked before anything starts (a trainer, Ray, engine actors): the plug-ins
    import, the choices are known ones, engine_args are ServerArgs fields. A bad value is a
    ValueError naming the field, not an engine actor's traceback minutes later."""
    from engine.config import ServerArgs
    from recipes.weight_push import RECIPE_TRANSPORTS
    from trainer_bridge.losses import AGGREGATIONS

    if recipe.off_policy and recipe.colocate:
        raise ValueError("off_policy needs engines generating while the trainer steps; colocate releases them then")
    if recipe.aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {recipe.aggregation!r}")
    if recipe.transport not in RECIPE_TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(RECIPE_TRANSPORTS)}; got {recipe.transport!r}")
    try:
        torch.device(recipe.device)
    except RuntimeError:
        raise ValueError(f"device {recipe.device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if not isinstance(getattr(torch, recipe.dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, ...); got {recipe.dtype!r}")
    try:
        ServerArgs.from_kwargs(**{"model_path": recipe.model, "dtype": recipe.dtype, **recipe.engine_args})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"engine_args: {exc}") from None
    load_object(recipe.task, "task")
    load_object(recipe.reward, "reward")
    if recipe.rollout_fn:
        load_object(recipe.rollout_fn, "rollout_fn")


def run(recipe: Recipe, output_dir: Path, quiet: bool = False) -> RunResult:
    check_recipe(recipe)
    source = ModelSource.resolve(recipe.model, recipe.seed)  # a bad model path: refused before the run folder
    output_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if recipe.torch_threads > 0:
        torch.set_num_threads(recipe.torch_threads)
    torch.manual_seed(recipe.seed)
    report = RunReport(output_dir, recipe, quiet)
    report.plan(plan_line(recipe, source, output_dir))
    try:
        checkpoint, last_groups = _run_phases(recipe, source, report, output_dir)
    finally:
        curve = report.close()
        torch.set_num_threads(threads)  # the caller's setting, as it was
    return RunResult(output_dir, report.rows, checkpoint, curve, last_groups)


def _run_phases(recipe: Recipe, source: ModelSource, report: RunReport,
                output_dir: Path) -> tuple[Optional[Path], list]:
    """trainer -> engines -> warm start -> push version 0 -> GRPO steps -> checkpoint."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    task = load_object(recipe.task, "task")(**recipe.task_args)
    reward_fn = load_object(recipe.reward, "reward")
    rollout_fn = load_object(recipe.rollout_fn, "rollout_fn") if recipe.rollout_fn else None
    start = time.perf_counter()
    trainer = build_trainer(recipe, source)
    report.note(f"trainer ready in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    with EnginePool(recipe, source) as pool:
        report.note(f"{recipe.num_engines} engines ready in {time.perf_counter() - start:.1f}s")
        pusher = WeightPusher(pool.clients, recipe.transport, recipe.bucket_bytes, recipe.keep_cuda_graphs)
        if recipe.warm_start_steps:
            _warm_start(recipe, trainer, task, tokenizer, report)
        if recipe.kl_coef > 0:
            trainer.freeze_reference()
        pusher.push(trainer, "0")  # the engines start from the (warm-started) policy
        rollouts = Rollouts(recipe, pool.clients, tokenizer, task, reward_fn, rollout_fn)
        last_groups = _grpo_steps(recipe, trainer, rollouts, pusher, report)
    checkpoint = None
    if recipe.save_checkpoint:
        checkpoint = trainer.save_hf_checkpoint(source.path, str(output_dir / "checkpoint"))
    return checkpoint, last_groups


def _warm_start(recipe: Recipe, trainer: Any, task: Any, tokenizer: Any, report: RunReport) -> None:
    start = time.perf_counter()
    losses = warm_start(trainer, task, tokenizer, recipe)
    trainer.reset_optimizer()  # RL starts with fresh moments
    report.note(f"warm start: {len(losses)} supervised steps in {time.perf_counter() - start:.1f}s, "
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


def _grpo_steps(recipe: Recipe, trainer: Any, rollouts: Rollouts, pusher: WeightPusher,
                report: RunReport) -> list[list[Any]]:
    report.start_steps(recipe.steps)
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
    try:
        pending: Future = background.submit(rollouts.generate, 1)
        groups: list = []
        for step in range(1, recipe.steps + 1):
            wait_start = time.perf_counter()
            result: RolloutResult = pending.result()
            waited = time.perf_counter() - wait_start
            if recipe.off_policy and step < recipe.steps:  # generated on the current weights while this step trains
                pending = background.submit(rollouts.generate, step + 1)
            metrics = _train_and_push(recipe, trainer, pusher, result, step, waited, pending)
            if not recipe.off_policy and step < recipe.steps:
                pending = background.submit(rollouts.generate, step + 1)
            report.step(metrics)
            groups = result.groups
        return groups
    finally:
        background.shutdown(wait=True)


def _train_and_push(recipe: Recipe, trainer: Any, pusher: WeightPusher, result: RolloutResult, step: int,
                    waited: float, pending: Future) -> dict:
    samples = result.samples
    rewards = torch.tensor([[s.reward for s in g] for g in result.groups], dtype=torch.float32)
    advantages = group_advantages(rewards, normalize_std=recipe.normalize_std).flatten().tolist()
    batch = RolloutBatch.from_samples(samples, advantages)
    train_start = time.perf_counter()
    phases: dict[str, float] = {}
    if recipe.colocate:  # sync_s: the push; release/resume times apart
        train, timed = pusher.colocated(lambda: trainer.train_step(batch, recipe.lr), trainer, str(step))
        train_s, sync_s = timed.train, timed.push
        phases = {f"{name}_s": seconds for name, seconds in timed.as_dict().items() if name not in ("train", "push")}
    else:
        train = trainer.train_step(batch, recipe.lr)
        train_s = time.perf_counter() - train_start
        if recipe.off_policy and not pending.done():
            pending.result()  # the next step's rollouts finish on the old weights before the push
        sync_s = pusher.push(trainer, str(step))
    versions = sorted({v for s in samples for v, m in zip(s.weight_versions, s.loss_mask) if m})
    return {
        "step": step, "weight_version": step, "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "accuracy": sum(1 for s in samples if s.reward >= 1.0) / max(len(samples), 1),
        "rollout_s": result.seconds, "rollout_wait_s": waited,
        "rollout_tok_s": result.generated_tokens / max(result.seconds, 1e-9),
        "train_s": train_s, "sync_s": sync_s, "response_len_mean": result.generated_tokens / max(len(samples), 1),
        "truncated": sum(1 for s in samples if s.status == "truncated") / max(len(samples), 1),
        "rollout_weight_versions": versions, **phases, **train, **_trainer_memory(),
    }


def _trainer_memory() -> dict:
    """GiB: this (trainer) process's peak allocation since the last step, and the whole device's use
    now (colocated engines included); nothing on the CPU."""
    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated() / (1 << 30)
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {"trainer_peak_mem_gib": peak, "device_used_gib": (total - free) / (1 << 30)}
