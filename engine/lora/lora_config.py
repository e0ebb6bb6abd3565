"""LoRAConfig: what tandem reads of PEFT's adapter_config.json, checked against the server's limits.

scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as PEFT computes it. What tandem
does not serve (DoRA, per-module rank or alpha patterns, LoRA on biases or embeddings) is refused
by name rather than served wrongly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

# the decoder's linear layers, by their HF names (PEFT's target_modules spelling)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRALimits:
    """--max-lora-rank and --lora-target-modules (None: any rank / any of LORA_TARGETS)."""
    max_rank: Optional[int] = None
    target_modules: Optional[frozenset[str]] = None

    @classmethod
    def from_flags(cls, max_rank: Optional[int], target_modules: Optional[tuple[str, ...]]) -> "LoRALimits":
        targets = None if not target_modules else frozenset(expand_targets(target_modules))
        return cls(max_rank, targets)


def expand_targets(names: Any) -> list[str]:
    """PEFT's target_modules: a list of module names, or "all-linear" / "all" (every linear)."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names or []:
        if name in ("all-linear", "all"):
            out += [t for t in LORA_TARGETS if t not in out]
        elif name not in LORA_TARGETS:
            raise ValueError(f"LoRA target module {name!r} is not supported; targets are "
                             f"{', '.join(LORA_TARGETS)} (or all-linear)")
        elif name not in out:
            out.append(name)
    return out


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, config: Any, limits: LoRALimits) -> "LoRAConfig":
        if not isinstance(config, dict):
            raise ValueError(f"a LoRA config is PEFT's adapter_config (a JSON object); got {type(config).__name__}")
        _refuse_unsupported(config)
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"LoRA config 'r' must be a positive integer; got {rank!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"LoRA config 'lora_alpha' must be a number; got {alpha!r}")
        if limits.max_rank is not None and rank > limits.max_rank:
            raise ValueError(f"LoRA rank {rank} exceeds --max-lora-rank {limits.max_rank}")
        targets = tuple(expand_targets(config.get("target_modules")))
        if not targets:
            raise ValueError("LoRA config names no target_modules")
        if limits.target_modules is not None:
            outside = [t for t in targets if t not in limits.target_modules]
            if outside:
                raise ValueError(f"LoRA target module(s) {', '.join(outside)} not allowed by --lora-target-modules "
                                 f"({', '.join(sorted(limits.target_modules))})")
        return cls(rank, float(alpha), targets, bool(config.get("use_rslora", False)))


def _refuse_unsupported(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter peft_type {config.get('peft_type')!r} is not served; only LORA")
    if config.get("use_dora"):
        raise ValueError("DoRA adapters (use_dora) are not served")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA config {key!r} (per-module rank or alpha) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA config bias={config.get('bias')!r} is not supported; only 'none'")
    if config.get("modules_to_save"):
        raise ValueError("LoRA config modules_to_save (fully trained modules) is not supported")
