"""LoRAAdapter: one PEFT LoRA adapter laid out on the engine's (stacked) linear layers.

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` ([r, in]) or `.lora_B.weight`
([out, r]). The HF module maps to an engine module and shard through the one HF-name map
(engine/models/hf_names.py): q_proj is shard "q" of qkv_proj, gate_proj shard 0 of gate_up_proj.
Names resolve through the model's LoRATargets (engine/lora/lora_targets.py, found once per model).
A stacked module keeps its shards' A matrices concatenated ([shards * r, in]: one product for
all of them) and each shard's B with the output rows it adds to; all are views of few buffers
the tensors are copied into at once (engine/lora/lora_layout.py). Every name and shape is checked
before the adapter exists, so a bad adapter is a ValueError and nothing half-loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import batch_invariant as bi
from engine.lora.lora_config import LoRAConfig, LoRALimits
from engine.lora.lora_layout import lay_out
from engine.lora.lora_targets import LoRATarget, lora_targets


@dataclass
class LoRAShard:
    rows: slice  # the module's output rows this shard adds to
    cols: slice  # its columns of the module's stacked A product
    lora_b: torch.Tensor  # [rows, r]


@dataclass
class LoRAModule:
    """One engine linear's delta: scaling * B(A(x)) per shard."""
    lora_a: torch.Tensor  # [shards * r, in]
    shards: list[LoRAShard]
    scaling: float

    def delta_into(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """out with scaling * B(A(x[rows])) added to `rows`; every row computed alone (batch-
        invariant matmuls in deterministic mode), the others left bit for bit as they were."""
        matmul = bi.linear if deterministic else F.linear
        hidden = matmul(x[rows], self.lora_a, None)
        for shard in self.shards:
            delta = matmul(hidden[:, shard.cols], shard.lora_b, None) * self.scaling
            out[:, shard.rows].index_add_(0, rows, delta.to(out.dtype))
        return out


@dataclass
class LoRAAdapter:
    name: str
    path: Optional[str]  # None: loaded from tensors
    config: LoRAConfig
    modules: dict[str, LoRAModule]  # engine module name -> its delta
    pinned: bool = False

    @classmethod
    def from_dir(cls, name: str, path: str, model: nn.Module, limits: LoRALimits, pinned: bool = False
                 ) -> "LoRAAdapter":
        config_file = os.path.join(path, "adapter_config.json")
        weights_file = os.path.join(path, "adapter_model.safetensors")
        for needed in (config_file, weights_file):
            if not os.path.isfile(needed):
                raise ValueError(f"LoRA adapter {name!r}: {needed} does not exist (PEFT's format: "
                                 f"adapter_config.json + adapter_model.safetensors)")
        try:
            with open(config_file) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"LoRA adapter {name!r}: {config_file} is not JSON: {exc}") from exc
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(weights_file)
        except (SafetensorError, OSError) as exc:  # truncated, corrupt, unreadable
            raise ValueError(f"LoRA adapter {name!r}: {weights_file} cannot be read as safetensors: {exc}") from exc
        return cls.from_tensors(name, config, tensors.items(), model, limits, path, pinned)

    @classmethod
    def from_tensors(cls, name: str, config: Any, tensors: Iterable[tuple[str, Any]], model: nn.Module,
                     limits: LoRALimits, path: Optional[str] = None, pinned: bool = False) -> "LoRAAdapter":
        try:
            cfg = LoRAConfig.from_dict(config, limits)
            modules = _build_modules(cfg, tensors, model)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        return cls(name, path, cfg, modules, pinned)


def _build_modules(cfg: LoRAConfig, tensors: Iterable[tuple[str, Any]], model: nn.Module) -> dict[str, LoRAModule]:
    targets = lora_targets(model)
    found: dict[str, dict[Any, tuple[LoRATarget, dict[str, torch.Tensor]]]] = {}  # module -> shard id -> pair
    for tensor_name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or not torch.is_floating_point(tensor) or tensor.dim() != 2:
            raise ValueError(f"tensor {tensor_name!r} must be a 2-D floating tensor")
        target, kind = targets.resolve(tensor_name, cfg.target_modules)
        found.setdefault(target.module_name, {}).setdefault(target.shard_id, (target, {}))[1][kind] = tensor
    if not found:
        raise ValueError("it holds no lora_A / lora_B tensors")
    checked = {m: _checked_shards(m, shards, cfg.rank) for m, shards in found.items()}
    param = next(model.parameters())
    placed = lay_out({m: [(a, b) for _, a, b in shards] for m, shards in checked.items()}, param.device, param.dtype)
    return {m: _module(shards, *placed[m], cfg) for m, shards in checked.items()}


def _module(shards: list[tuple[LoRATarget, torch.Tensor, torch.Tensor]], lora_a: torch.Tensor,
            lora_b: list[torch.Tensor], cfg: LoRAConfig) -> LoRAModule:
    r = cfg.rank
    return LoRAModule(lora_a, [LoRAShard(target.rows, slice(k * r, (k + 1) * r), b)
                               for k, ((target, _, _), b) in enumerate(zip(shards, lora_b))], cfg.scaling)


def _checked_shards(module_name: str, shards: dict[Any, tuple[LoRATarget, dict[str, torch.Tensor]]], r: int
                    ) -> list[tuple[LoRATarget, torch.Tensor, torch.Tensor]]:
    """(target, lora_A, lora_B) per shard, in the order its A matrices stack (shard ids as strings)."""
    out = []
    for shard_id, (target, pair) in sorted(shards.items(), key=lambda s: str(s[0])):
        label = module_name if shard_id is None else f"{module_name} shard {shard_id!r}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{label} has lora_{''.join(pair)} but no lora_{'B' if 'A' in pair else 'A'}")
        _check_shape(label, "lora_A", pair["A"], (r, target.in_features))
        _check_shape(label, "lora_B", pair["B"], (target.out_rows, r))
        out.append((target, pair["A"], pair["B"]))
    return out


def _check_shape(label: str, kind: str, tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{label}: {kind} has shape {list(tensor.shape)}, expected {list(expected)} "
                         f"(rank {expected[0] if kind == 'lora_A' else expected[1]})")
