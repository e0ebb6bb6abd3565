"""The one map between HF checkpoint names and engine parameters.

Engine parameters carry HF names except where several checkpoint tensors are stacked into one
parameter (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`). A stacked tensor is addressed by a
key (engine parameter name, shard id); shard id None is a whole parameter. The loader, weight
updates, /get_weights_by_name, checkpoint export and the bench's HF copy all read names here.

A new stacked layout (LoRA A/B) is one more rule in a model's `hf_stacking` table, whose module
offers `shard_ids` and `shard_slice` (StackedShards): experts stacked per layer are
`ExpertStacking` (shard id (expert, part)) in the MoE models' table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Protocol, runtime_checkable

import torch
from torch import nn

# a loaded checkpoint tensor lands on (parameter name, shard id); shard id None = whole parameter
WeightKey = tuple[str, Any]


@runtime_checkable
class StackedShards(Protocol):
    """A module whose parameters hold several checkpoint tensors: the shard ids it holds, and
    where each one sits (an index into the parameter, e.g. a slice of rows)."""

    @property
    def shard_ids(self) -> list[Any]: ...

    def shard_slice(self, shard_id: Any) -> Any: ...


@dataclass(frozen=True)
class Stacking:
    """The HF module `hf` is shard `shard_id` of the engine's stacked module `engine`."""
    engine: str
    hf: str
    shard_id: Any

    def to_engine(self, hf_name: str) -> Optional[WeightKey]:
        part = f".{self.hf}."
        return (hf_name.replace(part, f".{self.engine}."), self.shard_id) if part in hf_name else None

    def to_hf(self, param_name: str, shard_id: Any) -> Optional[str]:
        part = f".{self.engine}."
        if shard_id != self.shard_id or part not in param_name:
            return None
        return param_name.replace(part, f".{self.hf}.")


@dataclass(frozen=True)
class ExpertStacking:
    """HF's per-expert `experts.{e}.{hf}` is shard (e, part) of the stacked `experts.{engine}`
    ([num_experts, rows, cols]); e.g. experts.3.up_proj -> experts.gate_up_proj, shard (3, "up")."""
    engine: str
    hf: str
    part: str

    def to_engine(self, hf_name: str) -> Optional[WeightKey]:
        match = re.search(rf"\.experts\.(\d+)\.{self.hf}\.", hf_name)
        if match is None:
            return None
        engine = hf_name[:match.start()] + f".experts.{self.engine}." + hf_name[match.end():]
        return engine, (int(match.group(1)), self.part)

    def to_hf(self, param_name: str, shard_id: Any) -> Optional[str]:
        part = f".experts.{self.engine}."
        if not (isinstance(shard_id, tuple) and shard_id[1] == self.part and part in param_name):
            return None
        return param_name.replace(part, f".experts.{shard_id[0]}.{self.hf}.")


@dataclass(frozen=True)
class FusedExpertAlias:
    """transformers 5.x names the stacked tensors `experts.gate_up_proj` / `experts.down_proj`
    (no `.weight`; same [E, rows, cols] layout as the engine's): loads as the whole parameter.
    Export keeps the per-expert names that checkpoints on the Hub (and save_pretrained) use."""
    name: str

    def to_engine(self, hf_name: str) -> Optional[WeightKey]:
        return (hf_name + ".weight", None) if hf_name.endswith(f".experts.{self.name}") else None

    def to_hf(self, param_name: str, shard_id: Any) -> Optional[str]:
        return None


# experts stacked per layer (Qwen3-MoE, Qwen2-MoE): before the dense rules, which would also
# match the `.gate_proj.` inside an expert's name
EXPERT_STACKING = (
    ExpertStacking("gate_up_proj", "gate_proj", "gate"),
    ExpertStacking("gate_up_proj", "up_proj", "up"),
    ExpertStacking("down_proj", "down_proj", "down"),
    FusedExpertAlias("gate_up_proj"),
    FusedExpertAlias("down_proj"),
)

# the dense decoders' layout (Llama, Qwen2, Qwen3), as SGLang stacks them
DENSE_STACKING: tuple[Stacking, ...] = (
    Stacking("qkv_proj", "q_proj", "q"),
    Stacking("qkv_proj", "k_proj", "k"),
    Stacking("qkv_proj", "v_proj", "v"),
    Stacking("gate_up_proj", "gate_proj", 0),
    Stacking("gate_up_proj", "up_proj", 1),
)


class HFNameMap:
    """HF names <-> keys of one engine model; `model.hf_stacking` is its table of rules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rules: tuple[Any, ...] = getattr(model, "hf_stacking", DENSE_STACKING)
        self.tied = bool(getattr(model, "tie_word_embeddings", False))

    def skipped(self, hf_name: str) -> bool:
        """Checkpoint tensors the engine does not load: rope buffers, a tied lm_head."""
        return "rotary_emb.inv_freq" in hf_name or (self.tied and hf_name == "lm_head.weight")

    def engine_key(self, hf_name: str) -> WeightKey:
        """HF name -> key; a name no rule stacks is its own parameter name (checked by callers)."""
        for rule in self.rules:
            key = rule.to_engine(hf_name)
            if key is not None:
                return key
        return hf_name, None

    def hf_name(self, param_name: str, shard_id: Any) -> str:
        if shard_id is None:
            return param_name
        for rule in self.rules:
            name = rule.to_hf(param_name, shard_id)
            if name is not None:
                return name
        raise KeyError(f"no HF name for shard {shard_id!r} of {param_name}")

    def view(self, param_name: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` (the parameter's full value) that the key addresses."""
        if shard_id is None:
            return tensor
        return tensor[self.stacked_module(param_name).shard_slice(shard_id)]

    def stacked_module(self, param_name: str) -> Optional[StackedShards]:
        module_name = param_name.rpartition(".")[0]
        module = self.model.get_submodule(module_name) if module_name else self.model
        return module if isinstance(module, StackedShards) else None

    def keys_covered(self, param_name: str, shard_id: Any) -> set[WeightKey]:
        """A whole stacked parameter (engine name, e.g. from weight sync) covers all its shards."""
        module = self.stacked_module(param_name)
        if module is None:
            return {(param_name, None)}
        if shard_id is not None:
            return {(param_name, shard_id)}
        return {(param_name, sid) for sid in module.shard_ids}

    def expected(self) -> list[tuple[str, WeightKey]]:
        """(HF name, key) of every checkpoint tensor the model loads, in parameter order."""
        out = []
        for param_name, _ in self.model.named_parameters():  # a tied lm_head is listed once, as the embedding
            for key in sorted(self.keys_covered(param_name, None), key=str):
                out.append((self.hf_name(*key), key))
        return out

    def missing(self, loaded: set[WeightKey]) -> list[str]:
        """HF names of the checkpoint tensors not in `loaded`."""
        return [name for name, key in self.expected() if key not in loaded]

    def hf_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine-named full tensors -> HF-named views (stacked ones split); a tied lm_head is dropped."""
        for param_name, tensor in named:
            module = self.stacked_module(param_name)
            shard_ids = [None] if module is None else module.shard_ids
            for sid in shard_ids:
                name = self.hf_name(param_name, sid)
                if not self.skipped(name):
                    yield name, self.view(param_name, sid, tensor)
