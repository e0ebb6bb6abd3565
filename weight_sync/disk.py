"""Safetensors checkpoints: the disk transport. Engine side DiskSource, trainer side DiskSender.

DiskSource reads through engine.models.loader.load_safetensors, the same function that loads the
checkpoint at start-up (so it stays in the engine: start-up never imports weight_sync).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from weight_sync.base import LoadContext, WeightSender, WeightSource


@dataclass
class DiskSource(WeightSource):
    """Every weight of a safetensors checkpoint of the same architecture."""
    kind: ClassVar[str] = "disk"
    model_path: str

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        from engine.models.loader import load_safetensors

        load_safetensors(model, self.model_path)


class DiskSender(WeightSender):
    """The whole update saved as one safetensors file in a temporary directory, which the engine
    loads with `update_weights_from_disk` (same machine or a shared filesystem); removed after."""
    kind: ClassVar[str] = "disk"
    bucketed: ClassVar[bool] = False

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="tandem-weights-") as path:
            save_file({n: t.contiguous().cpu() for n, t in bucket}, f"{path}/model.safetensors")
            return engine.update_weights_from_disk(path, weight_version=weight_version, flush_cache=flush_cache)
