"""What the server says it serves, fixed at start: the OpenAI model id, the tokenizer, the
architecture and the checkpoint's sampling defaults (the checkpoint served now is the Engine's
model_path, which a successful /update_weights_from_disk replaces)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ServedModel:
    name: str  # the OpenAI model id: --served-model-name, else the start-up model path
    tokenizer_path: str
    context_len: int
    model_type: Optional[str] = None  # from the checkpoint's config.json, as SGLang's /model_info
    architectures: Optional[list[str]] = field(default=None)
    sampling_defaults: dict = field(default_factory=dict)  # chat completions' unset sampling fields

    @classmethod
    def of(cls, engine: Any) -> "ServedModel":
        info = engine.info
        config = _hf_config(info.model_path)
        args = getattr(engine, "server_args", None)
        from_model = getattr(args, "sampling_defaults", "model") == "model"
        name = getattr(args, "served_model_name", None) or info.model_path  # SGLang's --served-model-name
        return cls(name=name, tokenizer_path=info.tokenizer_path,
                   context_len=info.context_len, model_type=config.get("model_type"),
                   architectures=config.get("architectures"),
                   sampling_defaults=model_sampling_defaults(info.model_path) if from_model else {})

    def card(self, created: int) -> dict:
        """One /v1/models entry."""
        return {"id": self.name, "object": "model", "created": created, "owned_by": "tandem", "root": self.name,
                "parent": None, "max_model_len": self.context_len}


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # SGLang's, from the checkpoint


def model_sampling_defaults(model_path: str) -> dict:
    """The sampling fields the checkpoint's generation_config.json sets (Qwen3: temperature 0.6,
    top_p 0.95, top_k 20), as SGLang's --sampling-defaults model applies them."""
    config = _hf_config(model_path, "generation_config.json")
    return {name: config[name] for name in SAMPLING_FIELDS
            if isinstance(config.get(name), (int, float)) and not isinstance(config.get(name), bool)}


def _hf_config(model_path: str, name: str = "config.json") -> dict:
    try:
        with open(os.path.join(model_path, name)) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
