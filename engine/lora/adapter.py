"""LoRAAdapter: one PEFT LoRA adapter laid out on the engine's (stacked) linear layers.

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` ([r, in]) or `.lora_B.weight`
([out, r]). The HF module maps to an engine module and shard through the one HF-name map
(engine/models/hf_names.py): q_proj is shard "q" of qkv_proj, gate_proj shard 0 of gate_up_proj.
A stacked module keeps its shards' A matrices concatenated ([shards * r, in]: one product for
all of them) and each shard's B with the output rows it adds to. Every name and shape is checked
before the adapter exists, so a bad adapter is a ValueError and nothing half-loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import batch_invariant as bi
from engine.lora.lora_config import LoRAConfig, LoRALimits
from engine.models.hf_names import HFNameMap

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


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
        from safetensors.torch import load_file

        return cls.from_tensors(name, config, load_file(weights_file).items(), model, limits, path, pinned)

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
    names = HFNameMap(model)
    param = next(model.parameters())
    found: dict[tuple[str, Any], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors:
        module_name, shard_id, kind = _locate(tensor_name, tensor, cfg, names, model)
        found.setdefault((module_name, shard_id), {})[kind] = tensor
    if not found:
        raise ValueError("it holds no lora_A / lora_B tensors")
    by_module: dict[str, list[tuple[Any, dict[str, torch.Tensor]]]] = {}
    for (module_name, shard_id), pair in found.items():
        by_module.setdefault(module_name, []).append((shard_id, pair))
    return {m: _module(m, parts, cfg, model, param) for m, parts in by_module.items()}


def _locate(tensor_name: str, tensor: Any, cfg: LoRAConfig, names: HFNameMap, model: nn.Module
            ) -> tuple[str, Any, str]:
    """PEFT tensor name -> (engine module name, shard id, "A" | "B"); refuses anything else."""
    if not isinstance(tensor, torch.Tensor) or not torch.is_floating_point(tensor) or tensor.dim() != 2:
        raise ValueError(f"tensor {tensor_name!r} must be a 2-D floating tensor")
    match = _PEFT_NAME.match(tensor_name)
    if match is None:
        raise ValueError(f"unknown tensor {tensor_name!r}: not a PEFT lora_A / lora_B weight")
    hf_module, kind = match.groups()
    if hf_module.rpartition(".")[2] not in cfg.target_modules:
        raise ValueError(f"tensor {tensor_name!r} is for a module outside target_modules "
                         f"({', '.join(cfg.target_modules)})")
    param_name, shard_id = names.engine_key(hf_module + ".weight")
    module_name = param_name.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if not getattr(module, "lora_name", None):
        raise ValueError(f"unknown module {hf_module!r} (tensor {tensor_name!r}): the model has no such linear")
    return module_name, shard_id, kind


def _module(module_name: str, parts: list, cfg: LoRAConfig, model: nn.Module, param: torch.Tensor) -> LoRAModule:
    module = model.get_submodule(module_name)
    r, a_list, shards = cfg.rank, [], []
    for shard_id, pair in sorted(parts, key=lambda p: str(p[0])):
        label = module_name if shard_id is None else f"{module_name} shard {shard_id!r}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{label} has lora_{''.join(pair)} but no lora_{'B' if 'A' in pair else 'A'}")
        rows = slice(0, module.out_features) if shard_id is None else module.shard_slice(shard_id)
        _check_shape(label, "lora_A", pair["A"], (r, module.in_features))
        _check_shape(label, "lora_B", pair["B"], (rows.stop - rows.start, r))
        cols = slice(len(a_list) * r, (len(a_list) + 1) * r)
        a_list.append(pair["A"])
        shards.append(LoRAShard(rows, cols, pair["B"].to(param.device, param.dtype, copy=True).contiguous()))
    lora_a = torch.cat(a_list).to(param.device, param.dtype).contiguous()
    return LoRAModule(lora_a, shards, cfg.scaling)


def _check_shape(label: str, kind: str, tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{label}: {kind} has shape {list(tensor.shape)}, expected {list(expected)} "
                         f"(rank {expected[0] if kind == 'lora_A' else expected[1]})")
