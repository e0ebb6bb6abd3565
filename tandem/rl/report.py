"""RunReport: what a user sees of a run, and the files it leaves in the run folder.

The console gets a one-line plan, a tqdm bar over the steps and a table row per step; the run
folder gets metrics.jsonl (one JSON object per step), reward_curve.png (matplotlib, if installed)
and a wandb run (offline unless the user configured wandb; skipped with a note when wandb is not
installed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

COLUMNS = (  # (metric, header, format spec); a column is as wide as its header
    ("step", "step", "d"), ("reward_mean", "reward", ".3f"), ("accuracy", "accuracy", ".3f"),
    ("rollout_tok_s", "rollout tok/s", ".0f"), ("rollout_s", "rollout s", ".2f"),
    ("train_s", "train s", ".2f"), ("train_tflops", "train TFLOP/s", ".1f"), ("sync_s", "sync s", ".2f"),
    ("logprob_abs_diff_max", "logprob diff", ".3g"),
)
# (metric, label, unit) of the closing line: each phase's median over the steps after the first
# (the first compiles kernels and warms allocators)
PHASES = (("rollout_s", "rollout", "s"), ("train_s", "train", "s"), ("train_tflops", "train", "TFLOP/s"),
          ("return_cache_s", "trainer cache freed", "s"), ("sync_s", "push", "s"), ("release_s", "release", "s"), ("resume_weights_s", "resume weights", "s"),
          ("resume_kv_s", "resume KV + graphs", "s"))


class RunReport:
    def __init__(self, output_dir: Path, recipe: Any, quiet: bool = False) -> None:
        self.output_dir = output_dir
        self.recipe = recipe
        self.quiet = quiet
        self.rows: list[dict] = []
        self._metrics = open(output_dir / "metrics.jsonl", "w", encoding="utf-8")
        self._bar = None
        self._wandb = None

    def plan(self, text: str) -> None:
        self._print(text)

    def start_steps(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="GRPO", unit="step", disable=self.quiet, dynamic_ncols=True)
        self._print("  ".join(header for _, header, _ in COLUMNS))
        self._wandb = self._start_wandb()

    def step(self, metrics: dict) -> None:
        self.rows.append(metrics)
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        self._print("  ".join(format(metrics.get(k, float("nan")), f">{len(h)}{spec}") for k, h, spec in COLUMNS))
        if self._bar is not None:
            self._bar.update(1)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["step"])

    def note(self, text: str) -> None:
        self._print(text)

    def close(self) -> Optional[Path]:
        """-> the reward curve's path, when matplotlib could draw it."""
        if self._bar is not None:
            self._bar.close()
        if self.rows:
            self._print(phase_medians_line(self.rows))
        self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()
        return self._plot()

    def _print(self, text: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def _start_wandb(self) -> Any:
        if not self.recipe.wandb:
            return None
        try:
            import wandb
        except ImportError:
            self._print("note: wandb is not installed, so the run is not logged there (pip install wandb)")
            return None
        configured = bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"))
        configured = configured or "api.wandb.ai" in _read(Path.home() / ".netrc")
        mode = os.environ.get("WANDB_MODE", "online") if configured else "offline"
        try:
            run = wandb.init(project=self.recipe.wandb_project, dir=str(self.output_dir), mode=mode,
                             config=dataclasses.asdict(self.recipe), name=self.output_dir.name,
                             settings=wandb.Settings(silent=True, console="off"))
        except Exception as exc:  # logging must never stop a training run
            self._print(f"note: wandb did not start ({exc}); metrics are in metrics.jsonl")
            return None
        self._print(f"wandb: {mode} run in {self.output_dir / 'wandb'}"
                    + (" (`wandb sync` uploads it)" if mode == "offline" else ""))
        return run

    def _plot(self) -> Optional[Path]:
        try:
            import matplotlib
        except ImportError:
            self._print("note: matplotlib is not installed, so no reward_curve.png (pip install matplotlib)")
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(steps, [r["reward_mean"] for r in self.rows], marker="o", markersize=3)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("mean reward (samples, T=%g)" % self.recipe.temperature)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"tandem train: {self.recipe.name}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.output_dir / "reward_curve.png"
        fig.savefig(path)
        plt.close(fig)
        return path


def phase_medians_line(rows: list[dict]) -> str:
    """'medians over steps 2-5: rollout 1.19 s, train 0.73 s, ...' (step 1 alone when it is all)."""
    import statistics

    steps = rows[1:] or rows
    parts = []
    for key, label, unit in PHASES:
        values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        if values:
            value = statistics.median(values)
            parts.append(f"{label} {value:.3g} {unit}" if unit != "s" else f"{label} {value:.3f} s")
    span = f"step {steps[0]['step']}" if len(steps) == 1 else f"steps {steps[0]['step']}-{steps[-1]['step']}"
    return f"medians over {span}: " + ", ".join(parts)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
