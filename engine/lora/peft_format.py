"""PEFT's on-disk LoRA format, written: adapter_config.json + adapter_model.safetensors.

What a trainer saves (trainer_bridge/trainable_lora.py) and what the benches build (random
adapters of a model's shapes, engine/testing/random_lora.py); engine/lora/adapter.py reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

PEFT_PREFIX = "base_model.model."  # PEFT's prefix of a causal LM's module names


def peft_config_dict(rank: int, alpha: float, target_modules: Sequence[str],
                     base_model_name_or_path: Optional[str] = None) -> dict[str, Any]:
    """PEFT's adapter_config.json of a plain LoRA (no DoRA, no bias, no per-module patterns)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": float(alpha),
            "target_modules": list(target_modules), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path,
            "inference_mode": True}


def save_peft_adapter(out_dir: str, config: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """Writes the adapter's two files into out_dir (created); -> that directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors}
    save_file(host, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
