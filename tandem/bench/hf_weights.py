"""The engine model's weights under HF transformers' names: the inverse of `load_weights`.

The engine stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; the engine's HF-name
map (engine/models/hf_names.py) splits each stacked parameter back into its checkpoint tensors.
The tensors are views, not copies.
"""

from __future__ import annotations

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
    tensors = dict(hf_named_tensors(engine_model))
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    names = HFNameMap(engine_model)
    missing = [m for m in missing if not names.skipped(m) and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"engine -> HF weight copy does not line up: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if names.tied:
        hf_model.tie_weights()
