"""Build a model from its HF config and fill its weights from safetensors or dummy values."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from engine.models.layers import RMSNorm
from engine.models.registry import model_class_for_config
from engine.models.weight_cast import WeightsPartlyWritten

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
               load_format: str, seed: int = 0, deterministic: bool = False, tp: Optional[Any] = None) -> nn.Module:
    """Instantiate the registered class for `hf_config` on `device` in `dtype` and load weights.
    load_format: "auto"/"safetensors" read model_path/*.safetensors; "dummy" fills random
    weights (seeded) and reads no files. deterministic: batch-invariant kernels (DESIGN §4).
    tp: this rank's TPGroup (tp_size > 1): each parameter holds, and loads, its rank's shard of
    the full checkpoint tensor (dummy weights are drawn per rank, so they differ from TP=1's)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be one of auto, safetensors, dummy; got {load_format!r}")
    cls = model_class_for_config(hf_config)
    # built on meta then materialised uninitialised: nn.Linear's random init would dominate
    # start-up time; every parameter is filled below (missing ones raise)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(hf_config, deterministic=deterministic, **({"tp": tp} if tp is not None else {}))
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
        return [os.path.join(model_path, name) for name in _indexed_shards(index)]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path!r}")
    return files


def _indexed_shards(index: str) -> list[str]:
    """The shard file names an index's weight_map names; a ValueError (nothing written yet) for
    an index that is not JSON, has no weight_map object, or names a file outside its folder."""
    try:
        with open(index, "rb") as f:
            data = json.loads(f.read())
    except (ValueError, RecursionError) as exc:  # not JSON (or not UTF-8), or nested past the parser
        raise ValueError(f"{index} is not a safetensors index: {type(exc).__name__}: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} is not a safetensors index: it needs a non-empty \"weight_map\" object")
    bad = next((n for n in weight_map.values()
                if not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..")), None)
    if bad is not None:
        raise ValueError(f"{index}: weight_map values must be shard file names in the checkpoint's folder, "
                         f"got {bad!r}")
    return sorted(set(weight_map.values()))


def load_safetensors(model: nn.Module, model_path: str) -> None:
    """Check every tensor's name, shape and dtype (castable to its parameter's), and that none
    is missing, from the headers alone; only then load file by file. A bad checkpoint leaves the
    model as it was; a failure after the first write raises WeightsPartlyWritten."""
    from safetensors import safe_open

    files = safetensors_files(model_path)
    missing = model.missing_weights(model.check_weights(_header_specs(files)))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_path!r} is missing weights: {shown}")
    for done, path in enumerate(files):
        try:
            with safe_open(path, framework="pt") as f:
                model.load_weights((name, f.get_tensor(name)) for name in f.keys())
        except WeightsPartlyWritten:
            raise
        except Exception as exc:  # the headers were fine: the file changed or its data is unreadable
            if done == 0:
                raise
            raise WeightsPartlyWritten(f"reading {path!r} failed after {done} of {len(files)} files were "
                                       f"written: {type(exc).__name__}: {exc}") from exc


def _header_specs(files: list[str]) -> list[tuple[str, list[int], torch.dtype]]:
    """(name, shape, torch dtype) of every tensor, from the headers; unreadable files and dtypes
    torch cannot load as floats are refused here, before anything is written."""
    from safetensors import safe_open

    specs = []
    for path in files:
        try:
            f = safe_open(path, framework="pt")
        except Exception as exc:  # SafetensorError: a truncated or foreign file
            raise ValueError(f"cannot read {path!r} as safetensors: {exc}") from exc
        with f:
            for name in f.keys():
                header = f.get_slice(name)
                raw, dtype = header.get_dtype(), _torch_float(header.get_dtype())
                if dtype is None:
                    kind = "dtype" if raw.startswith(("F", "BF")) else "non-floating dtype"
                    raise ValueError(f"weight {name!r} in {path!r} has {kind} {raw}, which the loader cannot "
                                     f"read as floats; use one of {', '.join(_loadable_dtypes())}")
                specs.append((name, header.get_shape(), dtype))
    return specs


# safetensors dtype names -> torch float dtypes they load as (F4 / F6_* load packed, or not at all)
_SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
                       "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


def _torch_float(safetensors_dtype: str) -> Optional[torch.dtype]:
    name = _SAFETENSORS_FLOATS.get(safetensors_dtype)
    return getattr(torch, name, None) if name else None


def _loadable_dtypes() -> list[str]:
    return [k for k in _SAFETENSORS_FLOATS if _torch_float(k) is not None]


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
