"""LoRATargets: the linears of one model a LoRA adapter may target, resolved once per model.

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` ([r, in]) or `.lora_B.weight`
([out, r]). The HF module maps to an engine module and shard through the one HF-name map
(engine/models/hf_names.py): q_proj is shard "q" of qkv_proj, gate_proj shard 0 of gate_up_proj.
Walking the model for that per tensor (get_submodule, hasattr) was most of an adapter push's time
(504 tensors at 36 layers), so every target is found once per model (`lora_targets`, memoized
while the model lives) and a push is dict lookups; names already seen skip the regex too.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from engine.models.hf_names import HFNameMap

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_MAX_SEEN_PER_TARGET = 4  # PEFT names remembered per target (prefix, adapter-name variants; A and B)


@dataclass(frozen=True)
class LoRATarget:
    """HF module `hf_module` is shard `shard_id` (None: all) of engine linear `module_name`."""
    hf_module: str
    module_name: str
    shard_id: Any
    rows: slice  # the output rows of the engine linear it adds to
    in_features: int

    @property
    def out_rows(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def leaf(self) -> str:
        """What PEFT's target_modules calls it (q_proj, ...)."""
        return self.hf_module.rpartition(".")[2]


class LoRATargets:
    def __init__(self, model: nn.Module) -> None:
        names = HFNameMap(model)
        self.by_hf: dict[str, LoRATarget] = {}  # in model order
        for module_name, module in model.named_modules():
            if not getattr(module, "lora_name", ""):
                continue
            shard_ids = getattr(module, "shard_ids", None) or [None]
            for shard_id in shard_ids:
                try:
                    hf_module = names.hf_name(f"{module_name}.weight", shard_id).removesuffix(".weight")
                except KeyError:
                    continue  # no HF name: no tensor can reach it
                if names.engine_key(hf_module + ".weight") != (f"{module_name}.weight", shard_id):
                    continue  # nor one the map would not send back here
                rows = slice(0, module.out_features) if shard_id is None else module.shard_slice(shard_id)
                self.by_hf[hf_module] = LoRATarget(hf_module, module_name, shard_id, rows, module.in_features)
        self._seen: dict[str, tuple[LoRATarget, str]] = {}  # PEFT tensor name -> (target, "A" | "B")

    def resolve(self, tensor_name: str, target_modules: tuple[str, ...]) -> tuple[LoRATarget, str]:
        """PEFT tensor name -> (its target, "A" | "B"); a ValueError for anything else."""
        seen = self._seen.get(tensor_name)
        if seen is None:
            seen = self._parse(tensor_name, target_modules)
        if seen[0].leaf not in target_modules:
            raise _outside(tensor_name, target_modules)
        return seen

    def _parse(self, tensor_name: str, target_modules: tuple[str, ...]) -> tuple[LoRATarget, str]:
        match = _PEFT_NAME.match(tensor_name)
        if match is None:
            raise ValueError(f"unknown tensor {tensor_name!r}: not a PEFT lora_A / lora_B weight")
        hf_module, kind = match.groups()
        if hf_module.rpartition(".")[2] not in target_modules:
            raise _outside(tensor_name, target_modules)
        target = self.by_hf.get(hf_module)
        if target is None:
            raise ValueError(f"unknown module {hf_module!r} (tensor {tensor_name!r}): the model has no such linear")
        if len(self._seen) < _MAX_SEEN_PER_TARGET * len(self.by_hf):
            self._seen[tensor_name] = (target, kind)
        return target, kind


def _outside(tensor_name: str, target_modules: tuple[str, ...]) -> ValueError:
    return ValueError(f"tensor {tensor_name!r} is for a module outside target_modules ({', '.join(target_modules)})")


_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, LoRATargets]" = weakref.WeakKeyDictionary()


def lora_targets(model: nn.Module) -> LoRATargets:
    """The model's targets, found on first use (its linears are named when it is built)."""
    targets: Optional[LoRATargets] = _BY_MODEL.get(model)
    if targets is None:
        targets = _BY_MODEL[model] = LoRATargets(model)
    return targets
