"""HF `architectures[0]` -> model class, imported lazily so unused models cost nothing."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture name -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)


def model_class_for_config(hf_config: Any) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(
            "config.json has no 'architectures' entry; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return get_model_class(archs[0])
