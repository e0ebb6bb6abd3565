"""Safetensors checkpoints: the disk transport. Engine side DiskSource, trainer side DiskSender.

DiskSource reads through the LoadContext's `load_checkpoint`, which the engine sets to the function
that loads the checkpoint at start-up (weight_sync imports nothing of engine/).
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
    every_rank_reads: ClassVar[bool] = True  # each tensor-parallel rank reads its own shards
    success_message: ClassVar[Optional[str]] = "Succeeded to update model weights."  # SGLang's, word for word
    model_path: str
    load_format: Optional[str] = None

    def __post_init__(self) -> None:
        if self.load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {self.load_format!r} is not supported for disk updates; use 'auto'")

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        if ctx.load_checkpoint is None:
            raise ValueError("this engine cannot load checkpoints from disk (no loader in its LoadContext)")
        ctx.load_checkpoint(model, self.model_path)


class DiskSender(WeightSender):
    """The whole update saved as one safetensors file in a temporary directory, which the engine
    loads with `update_weights_from_disk` (same machine or a shared filesystem); removed after."""
    kind: ClassVar[str] = "disk"
    bucketed: ClassVar[bool] = False

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="tandem-weights-") as path:
            save_file({n: t.contiguous().cpu() for n, t in bucket}, f"{path}/model.safetensors")
            # (success, message, num_paused_requests), as sglang.Engine's: the first two
            ok, message = engine.update_weights_from_disk(path, weight_version=weight_version,
                                                          flush_cache=flush_cache)[:2]
            return ok, message
