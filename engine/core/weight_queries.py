"""Read-only views of the loaded weights: a parameter's first values by its HF name (SGLang's
/get_weights_by_name) and a checksum of every parameter (SGLang's get_weights_checksum).

Both run on the core, between steps, so they see the weights the next step uses.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
from torch import nn

from engine.models.hf_names import HFNameMap


def weights_checksum(named_params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, raw bytes) pairs sorted by name: SGLang's compute_weights_checksum, so
    a trainer can hash its own tensors (under the engine's names, stacked q/k/v and gate/up) and
    compare. Equal for equal weights on any device; dtype and layout are part of the bytes."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(named_params, key=lambda item: item[0]):
        hasher.update(name.encode())
        hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes on the host, in its dtype and row-major order."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


MAX_READ_VALUES = 1 << 22  # a JSON list of ~4M floats (~80 MB), read on the core's thread


def weights_by_name(model: nn.Module, name: str, truncate_size: int = 100) -> list:
    """The first `truncate_size` rows (or values, for 1-D) of the parameter an HF checkpoint name
    loads into, as float lists; q/k/v and gate/up names read their slice of the stacked weight,
    a tied lm_head reads the embedding. At most MAX_READ_VALUES values: a whole embedding as
    floats would stall generation for seconds and make a reply of GBs (/weights_checker's
    checksum compares whole tensors)."""
    if not isinstance(truncate_size, int) or truncate_size < 0:
        raise ValueError(f"truncate_size must be a non-negative int, got {truncate_size!r}")
    part = _resolve(model, name)[:truncate_size]
    if part.numel() > MAX_READ_VALUES:
        row = max(part[0].numel(), 1) if part.dim() > 1 else 1
        raise ValueError(f"{name}[:{truncate_size}] has {part.numel():,} values, over the {MAX_READ_VALUES:,} this "
                         f"route returns: ask for truncate_size <= {MAX_READ_VALUES // row}, or checksum the "
                         "weights with /weights_checker")
    return part.detach().float().cpu().tolist()


def _resolve(model: nn.Module, name: str) -> torch.Tensor:
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head reads the embedding
    if name in params:
        return params[name]
    names = HFNameMap(model)
    param_name, shard_id = names.engine_key(name)
    if param_name in params:  # a stacked shard, or an alias of a whole parameter (fused experts)
        return names.view(param_name, shard_id, params[param_name])
    raise ValueError(f"no parameter named {name!r}: give an HF checkpoint name such as "
                     "'model.layers.0.self_attn.q_proj.weight' or 'lm_head.weight'")
