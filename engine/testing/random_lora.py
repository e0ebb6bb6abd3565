"""Random PEFT LoRA adapters of a checkpoint's shapes, for benches and tests: no download and no
model load (shapes from its safetensors headers or its config, engine/testing/checkpoint_shapes.py),
so real-shape presets with dummy weights get adapters too. lora_A is scaled as PEFT's kaiming
init scales it; lora_B is non-zero (PEFT starts it at zero), so the adapter really changes outputs.
Only dense linears get adapters: MoE experts are not LoRA targets the engine serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from engine.lora.lora_config import LORA_TARGETS, expand_targets
from engine.lora.peft_format import PEFT_PREFIX, peft_config_dict, save_peft_adapter
from engine.testing.checkpoint_shapes import hf_parameter_shapes

LORA_B_STD = 0.02
_NOT_DENSE = (".experts.", "shared_expert")


def lora_shapes(model_path: str, target_modules: Sequence[str] = LORA_TARGETS) -> list[tuple[str, int, int]]:
    """(HF module name, output rows, in_features) of every dense linear among the targets."""
    targets = expand_targets(list(target_modules))
    out = []
    for name, shape in hf_parameter_shapes(model_path):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and module.rpartition(".")[2] in targets \
                and not any(part in module for part in _NOT_DENSE):
            out.append((module, int(shape[0]), int(shape[1])))
    if not out:
        raise ValueError(f"the model at {model_path} has no dense linear among {', '.join(targets)}")
    return out


def lora_tensor_specs(shapes: Sequence[tuple[str, int, int]], rank: int) -> list[tuple[str, torch.Size]]:
    """PEFT's (name, shape) of each lora_A [r, in] and lora_B [out, r], in module order."""
    specs = []
    for module, rows, cols in shapes:
        specs.append((f"{PEFT_PREFIX}{module}.lora_A.weight", torch.Size((rank, cols))))
        specs.append((f"{PEFT_PREFIX}{module}.lora_B.weight", torch.Size((rows, rank))))
    return specs


def fill_random_lora(named: Sequence[tuple[str, torch.Tensor]], seed: int) -> None:
    """Draws every lora_A / lora_B in place (the same buffers: a trainer's next step)."""
    gen = torch.Generator(named[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in named:
            std = tensor.shape[1] ** -0.5 if ".lora_A." in name else LORA_B_STD
            tensor.normal_(0.0, std, generator=gen)


def random_lora_tensors(shapes: Sequence[tuple[str, int, int]], rank: int, seed: int,
                        dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    named = [(name, torch.empty(shape, dtype=dtype)) for name, shape in lora_tensor_specs(shapes, rank)]
    fill_random_lora(named, seed)
    return named


def write_random_adapters(model_path: str, root: str, count: int, rank: int, alpha: Optional[float] = None,
                          target_modules: Sequence[str] = LORA_TARGETS, seed: int = 0,
                          dtype: torch.dtype = torch.float32) -> list[Path]:
    """`count` adapters (seeds seed, seed + 1, ...) in PEFT's format under root/adapter-<i>;
    alpha defaults to 2 * rank (scaling 2, PEFT's common choice)."""
    shapes = lora_shapes(model_path, target_modules)
    targets = sorted({module.rpartition(".")[2] for module, _, _ in shapes}, key=LORA_TARGETS.index)
    config = peft_config_dict(rank, 2.0 * rank if alpha is None else alpha, targets, model_path)
    return [save_peft_adapter(str(Path(root) / f"adapter-{i}"), config, random_lora_tensors(shapes, rank, seed + i, dtype))
            for i in range(count)]
