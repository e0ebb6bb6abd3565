"""Safetensors checkpoints: the disk transport (engine side: DiskSource)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from weight_sync.base import LoadContext, WeightSource


@dataclass
class DiskSource(WeightSource):
    """Every weight of a safetensors checkpoint of the same architecture."""
    kind: ClassVar[str] = "disk"
    model_path: str

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        from engine.models.loader import load_safetensors

        load_safetensors(model, self.model_path)
