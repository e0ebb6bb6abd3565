"""What the server says it serves: the OpenAI model id (fixed at start) and the checkpoint path,
which a successful /update_weights_from_disk replaces (as SGLang's /model_info shows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ServedModel:
    name: str  # the OpenAI model id: the start-up model path
    model_path: str
    tokenizer_path: str
    context_len: int

    @classmethod
    def of(cls, engine: Any) -> "ServedModel":
        info = engine.info
        return cls(name=info.model_path, model_path=info.model_path, tokenizer_path=info.tokenizer_path,
                   context_len=info.context_len)

    def card(self, created: int) -> dict:
        """One /v1/models entry."""
        return {"id": self.name, "object": "model", "created": created, "owned_by": "tandem", "root": self.name,
                "parent": None, "max_model_len": self.context_len}
