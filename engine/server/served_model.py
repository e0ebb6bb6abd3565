"""What the server says it serves: the OpenAI model id (fixed at start) and the checkpoint path,
which a successful /update_weights_from_disk replaces (as SGLang's /model_info shows)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ServedModel:
    name: str  # the OpenAI model id: the start-up model path
    model_path: str
    tokenizer_path: str
    context_len: int
    model_type: Optional[str] = None  # from the checkpoint's config.json, as SGLang's /model_info
    architectures: Optional[list[str]] = field(default=None)

    @classmethod
    def of(cls, engine: Any) -> "ServedModel":
        info = engine.info
        config = _hf_config(info.model_path)
        return cls(name=info.model_path, model_path=info.model_path, tokenizer_path=info.tokenizer_path,
                   context_len=info.context_len, model_type=config.get("model_type"),
                   architectures=config.get("architectures"))

    def card(self, created: int) -> dict:
        """One /v1/models entry."""
        return {"id": self.name, "object": "model", "created": created, "owned_by": "tandem", "root": self.name,
                "parent": None, "max_model_len": self.context_len}


def _hf_config(model_path: str) -> dict:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
