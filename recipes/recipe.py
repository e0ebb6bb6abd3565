"""Recipe: everything one RL run needs, as one frozen dataclass a person can read.

A recipe module (recipes/<name>.py, or any .py file) defines `RECIPE = Recipe(...)`; a YAML file
gives the fields to change from the defaults. Every field is a command-line override of
`tandem train` (`--steps 2 --lr 1e-3`, `--off-policy true`), applied by `with_overrides`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from recipes.recipe_data import MAX_BASE_CHAIN, check_size, check_yaml_nesting, read_text
from recipes.validate import check_fields, check_lora, lora_targets

TRAINERS = ("torch", "deepspeed")
ENGINE_BACKENDS = ("ray", "in_process")
ROUTED_EXPERTS_MODES = ("off", "measure", "replay")


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
    keep_cuda_graphs: bool = False  # colocated: the graphs' memory pool stays mapped (they replay either way)
    transport: str = "tensor"  # trainer_bridge.sync.TRANSPORTS
    bucket_bytes: int = 512 << 20
    # MoE: "measure": the engines return each sample's routed experts and the trainer reports
    # route_agreement (its routes vs the rollout's); "replay": also trains on the rollout's routes (R3)
    routed_experts: str = "off"
    # LoRA RL (lora_rank > 0): the base is frozen, only a PEFT adapter of this rank trains; each step
    # pushes the adapter alone (load_lora_adapter_from_tensors) and the run saves it in PEFT's format.
    # lora_target_modules: comma-separated HF module names (q_proj,...,down_proj) or all-linear
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: str = "all-linear"
    # ---- run
    deterministic: bool = True  # batch-invariant engine + Policy: logprob_abs_diff_max == 0
    off_policy: bool = False  # generate step k+1's rollouts while step k trains (TIS corrects)
    seed: int = 0
    torch_threads: int = 0  # trainer threads (0: torch's default)
    wandb: bool = True  # log to wandb (offline unless configured) when it is installed
    wandb_project: str = "tandem"
    save_checkpoint: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}; got {self.trainer!r}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine_backend must be one of {', '.join(ENGINE_BACKENDS)}; got {self.engine_backend!r}")
        if self.routed_experts not in ROUTED_EXPERTS_MODES:
            raise ValueError(f"routed_experts must be one of {', '.join(ROUTED_EXPERTS_MODES)}; "
                             f"got {self.routed_experts!r}")
        check_lora(self)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """lora_target_modules as PEFT's target_modules list (all-linear expanded)."""
        return lora_targets(self.lora_target_modules)


def load_recipe(name_or_path: str = "default") -> Recipe:
    """A recipe by name (recipes/<name>.py), by a .py path defining RECIPE, or a .yaml/.json file
    of fields over the defaults. Anything wrong (a missing file, a syntax error, an unknown field,
    a bad value) is one ValueError naming the file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json"):
        return _from_mapping(path)
    if path.suffix == ".py":
        module = _exec_file(path)
    elif re.fullmatch(r"\w+", name_or_path):
        module = _import_named(name_or_path)
    else:
        raise ValueError(f"recipe {name_or_path!r}: pass a recipe name ({', '.join(available_recipes())}), "
                         f"a .py file defining RECIPE, or a .yaml/.json file of fields")
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe {name_or_path!r} must define RECIPE = Recipe(...)")
    return recipe


def available_recipes() -> list[str]:
    here = Path(__file__).parent
    return sorted(p.stem for p in here.glob("*.py") if re.search(r"(?m)^RECIPE = Recipe\(", p.read_text()))


def _exec_file(path: Path) -> Any:
    if not path.is_file():
        hint = f" (a shipped recipe is named without .py: --recipe {path.stem})" \
            if path.stem in available_recipes() else ""
        raise ValueError(f"recipe file {path} does not exist{hint}")
    spec = importlib.util.spec_from_file_location(f"tandem_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report where it failed, in one line
        raise ValueError(f"recipe file {path}: {_where(exc, path)}") from exc
    return module


def _import_named(name: str) -> Any:
    file = Path(__file__).parent / f"{name}.py"
    try:
        return importlib.import_module(f"recipes.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"recipes.{name}":
            raise ValueError(f"recipe {name!r} ({file}): {_where(exc, file)}") from exc
        raise ValueError(f"no recipe {name!r}: expected recipes/{name}.py, a .py file or a .yaml/.json file "
                         f"(available: {', '.join(available_recipes())})") from exc
    except Exception as exc:
        raise ValueError(f"recipe {name!r} ({file}): {_where(exc, file)}") from exc


def _where(exc: BaseException, path: Path) -> str:
    """'line N: Kind: message', N the last line of the recipe file `path` the error passed."""
    if isinstance(exc, SyntaxError):
        return f"line {exc.lineno}: SyntaxError: {exc.msg}"
    line = None
    for frame, lineno in _frames(exc):
        if Path(frame).resolve() == path.resolve():
            line = lineno
    kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
    return (f"line {line}: " if line else "") + f"{kind}{exc}"


def _frames(exc: BaseException) -> list[tuple[str, int]]:
    import traceback

    return [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)
            if not f.filename.startswith("<")]


def with_overrides(recipe: Recipe, overrides: dict[str, Any], flags: bool = True) -> Recipe:
    """Fields replaced by values given as strings (from the command line) or typed values.
    flags: errors name the field as its command-line flag (--n-per-prompt), else as the field."""
    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    typed = {}
    for key, value in overrides.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            raise ValueError(f"unknown recipe field {key!r}; " + (f"did you mean {close[0]!r}?" if close else
                                                                  f"fields: {', '.join(fields)}"))
        label = f"--{name.replace('_', '-')}" if flags else name
        typed[name] = parse_value(fields[name], value, label) if isinstance(value, str) else value
    return dataclasses.replace(recipe, **typed)


def parse_value(f: dataclasses.Field, text: str, label: Optional[str] = None) -> Any:
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
            return _parse_int(text)
        return kind(text)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past the parser's limit
        label = label or f"--{f.name.replace('_', '-')}"
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise ValueError(f"{label}: cannot read {shown!r} as {getattr(kind, '__name__', kind)}") from None


def _parse_int(text: str) -> int:
    """"12", "0x10", or a whole number in float notation ("1e6", "2.0"); "1.5" is refused, not cut."""
    try:
        return int(text, 0) if text.strip().lower().startswith(("0x", "0o", "0b")) else int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


class BaseChainTooLong(ValueError):
    """Names the first file itself: not prefixed again by each file of the chain."""


_LOADING: list[Path] = []  # the recipe files whose `base:` chain is being read (a cycle never ends)


def _from_mapping(path: Path) -> Recipe:
    if not path.is_file():
        raise ValueError(f"recipe file {path} does not exist")
    if path.resolve() in _LOADING:
        chain = " -> ".join(str(p) for p in [*_LOADING, path.resolve()])
        raise ValueError(f"the base: chain comes back to {path} ({chain})")  # prefixed by the file naming it
    if len(_LOADING) >= MAX_BASE_CHAIN:
        raise BaseChainTooLong(f"recipe file {_LOADING[0]}: its base: chain is longer than {MAX_BASE_CHAIN} "
                               f"files (the {MAX_BASE_CHAIN + 1}th is {path})")
    _LOADING.append(path.resolve())
    try:
        return _from_data(path, _read_mapping(path))
    finally:
        _LOADING.pop()


def _from_data(path: Path, data: Any) -> Recipe:
    if not isinstance(data, dict):
        raise ValueError(f"recipe file {path}: a recipe file is a mapping of field: value")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None:
        raise ValueError(f"recipe file {path}: field names are strings, got {odd!r}")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ValueError(f"recipe file {path}: base must be a recipe name or file, got {base!r}")
    try:
        return with_overrides(load_recipe(base) if base else Recipe(), data, flags=False)
    except BaseChainTooLong:
        raise
    except ValueError as exc:
        raise ValueError(f"recipe file {path}: {exc}") from None


def _read_mapping(path: Path) -> Any:
    data = _parsed(path, read_text(path))
    check_size(data, path)
    return data


def _parsed(path: Path, text: str) -> Any:
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"recipe file {path} is not valid JSON: {exc.msg} (line {exc.lineno}, column "
                             f"{exc.colno})") from None
        except RecursionError:
            raise ValueError(f"recipe file {path} nests too deeply to read") from None
    try:
        import yaml
    except ImportError:
        raise ValueError(f"reading {path} needs PyYAML (pip install pyyaml), or write the recipe as "
                         f".json or .py") from None
    try:
        check_yaml_nesting(yaml, text, path)
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ValueError(f"recipe file {path} is not valid YAML: {getattr(exc, 'problem', None) or exc}"
                         f"{where}") from None
