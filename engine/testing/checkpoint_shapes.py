"""A checkpoint's weight names and shapes without loading its weights: what the benches' random
trainers and adapters are shaped after (real-shape presets ship a config only)."""

from __future__ import annotations

import torch


def hf_parameter_shapes(model_path: str) -> list[tuple[str, torch.Size]]:
    """(HF name, shape) of every weight: from the checkpoint's safetensors headers, or for a
    config-only checkpoint (real-shape presets) from its config on the meta device."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if files:
        shapes = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                shapes += [(name, torch.Size(f.get_slice(name).get_shape())) for name in f.keys()]
        return shapes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, p.shape) for name, p in model.named_parameters()]
