"""The GRPO loop of `tandem train`: rollouts -> rewards -> advantages -> update -> weight push.

Step k generates its groups on the engines (weight version k-1), computes GRPO advantages per
group, takes one optimizer step with the clipped objective and TIS on the rollout logprobs, and
pushes the new weights (version k) to every engine. LoRA RL (lora_rank > 0): the adapter alone
trains, is pushed, names the rollouts' lora_path and is saved in PEFT's format as the checkpoint. With `off_policy`, step k+1's rollouts are
generated on version k-1 while step k trains, and TIS corrects the one-step lag. The warm start
(supervised) runs first and its weights are pushed as version 0.
"""

from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tandem.rl.engines import EnginePool
from tandem.rl.interrupt import RunInterrupted, signals_stop_the_run
from tandem.rl.memory_check import check_cpu_memory
from tandem.rl.model_source import ModelSource
from tandem.rl.preflight import Plugins, preflight
from recipes.recipe import Recipe
from tandem.rl.report import RunReport
from tandem.rl.rollouts import RolloutResult, Rollouts
from tandem.rl.warm_start import warm_start
from tandem.rl.weight_push import WeightPusher
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
    if recipe.lora_rank:
        warm = f"LoRA rank {recipe.lora_rank} on {','.join(recipe.lora_targets)} (base frozen); " + warm
    return (f"tandem train [{recipe.name}]: {source.label} on {recipe.device}; {warm}{recipe.steps} GRPO steps x "
            f"{recipe.prompts_per_step} prompts x {recipe.n_per_prompt} samples of {recipe.task.split(':')[-1]}; "
            f"{engines}, {recipe.trainer} trainer, deterministic={recipe.deterministic}, "
            f"{'one-step off-policy' if recipe.off_policy else 'on-policy'}; run folder {output_dir}")


def run(recipe: Recipe, output_dir: Path, quiet: bool = False) -> RunResult:
    """The whole run; refused before its folder exists when preflight finds a problem. Ctrl-C or
    SIGTERM: the engines and Ray shut down on the way out, then RunInterrupted (a SystemExit:
    the CLI prints no traceback) after saying where the partial run is."""
    started: list[Path] = []  # the run folder, once this run has made it
    with signals_stop_the_run() as stop:
        try:
            return _run(recipe, output_dir, quiet, started)
        except KeyboardInterrupt:
            signum = stop.signum or signal.SIGINT
        except Exception:  # the CLI prints the error itself, as the last line
            if started:
                _say_stopped(recipe, started[0])
            raise
        _say_interrupted(signum, recipe, started[0] if started else None)
    raise RunInterrupted(signum)


def _run(recipe: Recipe, output_dir: Path, quiet: bool, started: list[Path]) -> RunResult:
    plugins = preflight(recipe, output_dir)
    source = ModelSource.resolve(recipe.model, recipe.seed)  # a bad model path: refused before the run folder
    check_cpu_memory(recipe, source.path)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output-dir {output_dir}: cannot create it ({exc.strerror}); pass a writable "
                         f"path") from None
    started.append(output_dir)
    threads = torch.get_num_threads()
    if recipe.torch_threads > 0:
        torch.set_num_threads(recipe.torch_threads)
    torch.manual_seed(recipe.seed)
    report = RunReport(output_dir, recipe, quiet)
    report.plan(plan_line(recipe, source, output_dir))
    try:
        checkpoint, last_groups = _run_phases(recipe, source, plugins, report, output_dir)
    finally:
        curve = report.close()
        torch.set_num_threads(threads)  # the caller's setting, as it was
    return RunResult(output_dir, report.rows, checkpoint, curve, last_groups)


def _say_interrupted(signum: int, recipe: Recipe, output_dir: Optional[Path]) -> None:
    metrics = output_dir / "metrics.jsonl" if output_dir else None
    if metrics is None or not metrics.exists():
        print(f"tandem train: interrupted ({signal.Signals(signum).name}) before the run started; nothing was "
              f"written", file=sys.stderr, flush=True)
        return
    print(f"tandem train: interrupted ({signal.Signals(signum).name}) after {_partial(recipe, output_dir)}",
          file=sys.stderr, flush=True)


def _say_stopped(recipe: Recipe, output_dir: Path) -> None:
    try:  # never in place of the error that stopped the run
        if (output_dir / "metrics.jsonl").exists():
            print(f"tandem train: stopped by an error after {_partial(recipe, output_dir)}", file=sys.stderr,
                  flush=True)
    except OSError:
        pass


def _partial(recipe: Recipe, output_dir: Path) -> str:
    done = len((output_dir / "metrics.jsonl").read_text().splitlines())
    saved = "metrics.jsonl" + (", reward_curve.png" if (output_dir / "reward_curve.png").exists() else "")
    checkpoint = output_dir / "checkpoint"
    whole = ((checkpoint / "model.safetensors").exists() and (checkpoint / "config.json").exists()  # written last
             or (checkpoint / "adapter_config.json").exists())
    saved += ", checkpoint/" if whole else "; no checkpoint"
    return f"{done} of {recipe.steps} steps; the partial run is in {output_dir} ({saved})"


def _run_phases(recipe: Recipe, source: ModelSource, plugins: Plugins, report: RunReport,
                output_dir: Path) -> tuple[Optional[Path], list]:
    """trainer -> engines -> warm start -> push version 0 -> GRPO steps -> checkpoint."""
    from transformers import AutoTokenizer  # here, not at the top: a Ctrl-C while it loads is caught by run()

    from tandem.rl.trainer_setup import build_trainer

    tokenizer = AutoTokenizer.from_pretrained(source.path)
    start = time.perf_counter()
    trainer = build_trainer(recipe, source)
    report.note(f"trainer ready in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    with EnginePool(recipe, source) as pool:
        report.note(f"{recipe.num_engines} engines ready in {time.perf_counter() - start:.1f}s")
        pusher = WeightPusher(pool.clients, recipe.transport, recipe.bucket_bytes, recipe.keep_cuda_graphs)
        if recipe.warm_start_steps:
            _warm_start(recipe, trainer, plugins.task, tokenizer, report)
        if recipe.kl_coef > 0:
            trainer.freeze_reference()
        pusher.push(trainer, "0")  # the engines start from the (warm-started) policy
        rollouts = Rollouts(recipe, pool.clients, tokenizer, plugins.task, plugins.reward_fn, plugins.rollout_fn)
        last_groups = _grpo_steps(recipe, trainer, rollouts, pusher, report)
    checkpoint = None
    if recipe.save_checkpoint and trainer.policy.lora is not None:  # PEFT's format, for the base model
        checkpoint = trainer.policy.lora.save_pretrained(str(output_dir / "checkpoint"))
    elif recipe.save_checkpoint:
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
    except BaseException:  # a failure or Ctrl-C: end the rollout in flight, do not wait it out
        rollouts.abort()
        raise
    finally:
        background.shutdown(wait=True, cancel_futures=True)


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
        "train_s": train_s, "train_tflops": train.get("train_tflop", 0.0) / max(train_s, 1e-9),
        "sync_s": sync_s, "response_len_mean": result.generated_tokens / max(len(samples), 1),
        "truncated": sum(1 for s in samples if s.status == "truncated") / max(len(samples), 1),
        "push_bytes": pusher.last_push_bytes,  # per engine: the adapter alone in LoRA RL
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
