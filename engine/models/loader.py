"""Build a model from its HF config and fill its weights from safetensors or dummy values."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Iterator, Union

import torch
from torch import nn

from engine.models.layers import RMSNorm
from engine.models.registry import model_class_for_config

DeviceLike = Union[str, torch.device]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype_str: str, hf_config: Any, device: DeviceLike) -> torch.dtype:
    """"auto": the checkpoint's dtype on GPU (float32 checkpoints served in bfloat16, as SGLang
    and vLLM do), float32 on CPU, where half-precision matmuls are slow and inexact."""
    if dtype_str != "auto":
        if dtype_str not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype_str!r}")
        return _DTYPES[dtype_str]
    if torch.device(device).type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."))
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.bfloat16


def load_model(model_path: str, hf_config: Any, dtype: torch.dtype, device: DeviceLike,
               load_format: str, seed: int = 0, deterministic: bool = False) -> nn.Module:
    """Instantiate the registered class for `hf_config` on `device` in `dtype` and load weights.
    load_format: "auto"/"safetensors" read model_path/*.safetensors; "dummy" fills random
    weights (seeded) and reads no files. deterministic: batch-invariant kernels (DESIGN §4)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be one of auto, safetensors, dummy; got {load_format!r}")
    cls = model_class_for_config(hf_config)
    # built on meta then materialised uninitialised: nn.Linear's random init would dominate
    # start-up time; every parameter is filled below (missing ones raise)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(hf_config, deterministic=deterministic)
    model = model.to_empty(device=device)
    model.init_non_checkpoint_state()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, model_path)
    model.requires_grad_(False)
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # building directly in the target dtype avoids a float32 copy of every weight; buffers that
    # must stay float32 (rope inv_freq) are created with an explicit dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's shard files: those named by the index when there is one, else all."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path!r}")
    return files


def load_safetensors(model: nn.Module, model_path: str) -> None:
    """Check every tensor's name and shape, and that none is missing, from the headers alone;
    only then load file by file (a bad checkpoint leaves the model as it was)."""
    from safetensors import safe_open

    files = safetensors_files(model_path)
    shapes = []
    for path in files:
        try:
            f = safe_open(path, framework="pt")
        except Exception as exc:  # SafetensorError: a truncated or foreign file
            raise ValueError(f"cannot read {path!r} as safetensors: {exc}") from exc
        with f:
            for name in f.keys():
                tensor = f.get_slice(name)
                if not tensor.get_dtype().startswith(("F", "BF")):  # safetensors' names: F32, BF16, I64, ...
                    raise ValueError(f"weight {name!r} in {path!r} has non-floating dtype {tensor.get_dtype()}")
                shapes.append((name, tensor.get_shape()))
    missing = model.missing_weights(model.check_weights(shapes))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_path!r} is missing weights: {shown}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            model.load_weights((name, f.get_tensor(name)) for name in f.keys())


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with a fixed seed: normal(0, 0.02) for matrices and embeddings, ones for
    norm weights, zeros for biases."""
    norm_params = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, param in model.named_parameters():
            if id(param) in norm_params:
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                gen = generators.get(param.device)
                if gen is None:
                    gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, 0.02, generator=gen)
