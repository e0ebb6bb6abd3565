"""Recipe: everything one RL run needs, as one frozen dataclass a person can read.

A recipe module (recipes/<name>.py, or any .py file) defines `RECIPE = Recipe(...)`; a YAML file
gives the fields to change from the defaults. Every field is a command-line override of
`tandem train` (`--steps 2 --lr 1e-3`, `--off-policy true`), applied by `with_overrides`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

TRAINERS = ("torch", "deepspeed")
ENGINE_BACKENDS = ("ray", "in_process")


@dataclass(frozen=True)
class Recipe:
    name: str = "custom"
    # ---- model: a tiny_model preset ("tiny", "qwen3-0.6b", ...; real shapes get random weights) or a path
    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    # ---- task and reward: dotted paths ("module:function"); rollout_fn for multi-turn rollouts
    task: str = "rollout.tasks:addition"
    task_args: dict = field(default_factory=dict)  # keyword arguments of the task factory
    reward: str = "rollout.rewards:exact_match"
    rollout_fn: Optional[str] = None  # async (ctx, problem, seed) -> Sample; None: one generate per sample
    # ---- sampling
    temperature: float = 1.0
    max_new_tokens: int = 4
    n_per_prompt: int = 8
    prompts_per_step: int = 16
    # ---- optimisation
    steps: int = 20
    lr: float = 1e-3
    micro_batch_size: int = 128
    max_grad_norm: float = 1.0
    warm_start_steps: int = 0  # supervised steps on the task's answers before RL
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    # ---- loss (trainer_bridge.losses.LossConfig)
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: Optional[float] = 2.0
    kl_coef: float = 0.0
    aggregation: str = "token_mean"
    normalize_std: bool = True  # GRPO's advantage normalisation (False: Dr. GRPO)
    # ---- engines, trainer, weight sync
    num_engines: int = 2
    engine_backend: str = "ray"  # ray: engine actors; in_process: Engines in this process
    engine_args: dict = field(default_factory=dict)  # extra Engine kwargs (ServerArgs fields)
    trainer: str = "torch"  # torch: AdamW here; deepspeed: ZeRO (GPU)
    zero_stage: int = 2
    colocate: bool = False  # engines release their GPU memory while the trainer steps
    keep_cuda_graphs: bool = False  # colocated: release weights + KV only; no graph re-capture per step
    transport: str = "tensor"  # trainer_bridge.sync.TRANSPORTS
    bucket_bytes: int = 512 << 20
    # ---- run
    deterministic: bool = True  # batch-invariant engine + Policy: logprob_abs_diff_max == 0
    off_policy: bool = False  # generate step k+1's rollouts while step k trains (TIS corrects)
    seed: int = 0
    torch_threads: int = 0  # trainer threads (0: torch's default)
    wandb: bool = True  # log to wandb (offline unless configured) when it is installed
    wandb_project: str = "tandem"
    save_checkpoint: bool = True

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}; got {self.trainer!r}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine_backend must be one of {', '.join(ENGINE_BACKENDS)}; got {self.engine_backend!r}")
        for name in ("steps", "n_per_prompt", "prompts_per_step", "num_engines", "max_new_tokens", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_per_prompt < 2:
            raise ValueError("n_per_prompt must be >= 2: GRPO compares samples of one prompt")
        for name, low, inclusive in (("temperature", 0, True), ("lr", 0, False), ("warm_start_lr", 0, False),
                                     ("max_grad_norm", 0, False), ("clip_low", 0, True), ("clip_high", 0, True),
                                     ("kl_coef", 0, True), ("tis_cap", 0, False)):
            _check_number(name, getattr(self, name), low, inclusive)
        for name in ("warm_start_steps", "torch_threads", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("warm_start_batch", "bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


def _check_number(name: str, value: Any, low: float, inclusive: bool) -> None:
    """A finite number above `low` (None passes: the optional fields' off)."""
    if value is None:
        return
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{name} must be a finite number {'>=' if inclusive else '>'} {low}, got {value}")


def load_recipe(name_or_path: str = "default") -> Recipe:
    """A recipe by name (recipes/<name>.py), by a .py path defining RECIPE, or a .yaml/.json file
    of fields over the defaults."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json"):
        return _from_mapping(path)
    if path.suffix == ".py":
        if not path.exists():
            raise ValueError(f"recipe file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"tandem_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(f"recipes.{name_or_path}")
        except ModuleNotFoundError as exc:
            raise ValueError(f"no recipe {name_or_path!r}: expected recipes/{name_or_path}.py, a .py file "
                             f"or a .yaml file (available: {', '.join(available_recipes())})") from exc
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe {name_or_path!r} must define RECIPE = Recipe(...)")
    return recipe


def available_recipes() -> list[str]:
    here = Path(__file__).parent
    return sorted(p.stem for p in here.glob("*.py") if re.search(r"(?m)^RECIPE = Recipe\(", p.read_text()))


def with_overrides(recipe: Recipe, overrides: dict[str, Any]) -> Recipe:
    """Fields replaced by values given as strings (from the command line) or typed values."""
    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    typed = {}
    for key, value in overrides.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ValueError(f"unknown recipe field {key!r}; fields: {', '.join(fields)}")
        typed[name] = parse_value(fields[name], value) if isinstance(value, str) else value
    return dataclasses.replace(recipe, **typed)


def parse_value(f: dataclasses.Field, text: str) -> Any:
    """A command-line string as the field's type: ints, floats, bools (true/false), None
    (none/null for optional fields), dicts as JSON."""
    kind = typing.get_type_hints(Recipe)[f.name]
    optional = typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)
    if optional:
        if text.lower() in ("none", "null", ""):
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if kind is dict:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        if kind is int:
            return int(float(text)) if "e" in text.lower() else int(text, 0)
        return kind(text)
    except ValueError:
        raise ValueError(f"--{f.name.replace('_', '-')}: cannot read {text!r} as {getattr(kind, '__name__', kind)}") \
            from None


def _from_mapping(path: Path) -> Recipe:
    if not path.exists():
        raise ValueError(f"recipe file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"reading {path} needs PyYAML (pip install pyyaml), or write the recipe as "
                             f".json or .py") from None
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe file is a mapping of field: value")
    base = load_recipe(data.pop("base")) if "base" in data else Recipe()
    return with_overrides(base, data)
