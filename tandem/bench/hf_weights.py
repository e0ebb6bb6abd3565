"""The engine model's weights under HF transformers' names: the inverse of `load_weights`.

The engine stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; the engine's HF-name
map (engine/models/hf_names.py) splits each stacked parameter back into its checkpoint tensors.
The tensors are views, not copies.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import nn

from engine.models.hf_names import HFNameMap


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; a tied lm_head appears once, as the embedding
    (named_parameters lists a shared parameter once)."""
    return HFNameMap(model).hf_tensors((name, param.detach()) for name, param in model.named_parameters())


def copy_into_hf(engine_model: nn.Module, hf_model: nn.Module) -> None:
    """Overwrite every HF parameter with the engine's value; raise if any is left unset."""
    tensors = _with_fused_experts(dict(hf_named_tensors(engine_model)), engine_model, hf_model)
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    names = HFNameMap(engine_model)
    missing = [m for m in missing if not names.skipped(m) and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"engine -> HF weight copy does not line up: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if names.tied:
        hf_model.tie_weights()


def _with_fused_experts(tensors: dict, engine_model: nn.Module, hf_model: nn.Module) -> dict:
    """transformers 5 holds each layer's experts fused (`experts.gate_up_proj` [E, 2I, H]), laid
    out as the engine's stacked parameter of that name + `.weight`: use it whole, not per expert."""
    params = dict(engine_model.named_parameters())
    fused = {name: params[name + ".weight"].detach() for name in hf_model.state_dict()
             if name not in tensors and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
             and name + ".weight" in params}
    if not fused:
        return tensors
    per_expert = re.compile(r"\.experts\.\d+\.")
    return {**{k: v for k, v in tensors.items() if not per_expert.search(k)}, **fused}
