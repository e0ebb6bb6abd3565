"""The engine model's weights under HF transformers' names: the inverse of `load_weights`.

The engine stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; here each stacked
parameter is split back into its checkpoint tensors by the module's own `shard_slice`, so the
layout knowledge stays in one place (StackedLinear). The tensors are views, not copies.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from engine.models.layers import StackedLinear


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter; a tied lm_head appears once, as the embedding."""
    shard_names = {(stacked, sid): ckpt for stacked, ckpt, sid in model.stacked_params_mapping}
    for name, param in model.named_parameters():  # shared parameters are listed once
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if not isinstance(module, StackedLinear):
            yield name, param.detach()
            continue
        stacked = module_name.rpartition(".")[2]
        for sid in module.shard_ids:
            hf_module = module_name[: -len(stacked)] + shard_names[(stacked, sid)]
            yield f"{hf_module}.{leaf}", param.detach()[module.shard_slice(sid)]


def copy_into_hf(engine_model: nn.Module, hf_model: nn.Module) -> None:
    """Overwrite every HF parameter with the engine's value; raise if any is left unset."""
    tensors = dict(hf_named_tensors(engine_model))
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    tied = getattr(engine_model, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight") and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"engine -> HF weight copy does not line up: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if tied:
        hf_model.tie_weights()
