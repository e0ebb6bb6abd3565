"""WeightPusher: the trainer's new weights into every engine, once per step.

One pause per engine for the whole update: the trainer hands out runs of full parameters (ZeRO-3
gathers one run at a time) and each goes to every engine at once before the next is drawn
(trainer_bridge.sync.push_to_engines). Colocated on one GPU, `colocated` wraps the train step in
trainer_bridge.colocate.colocated_step: engines release their memory, the trainer steps in it,
weights come back and are pushed, then the KV cache. LoRA RL (the policy has an adapter) pushes
the adapter alone instead (trainer_bridge.adapter_sync). `last_push_bytes`: what the last push
moved to each engine.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence, TypeVar

from trainer_bridge.colocate import ColocatePhases, colocated_step
from trainer_bridge.adapter_sync import push_adapter
from trainer_bridge.sync import push_to_engines

T = TypeVar("T")
RECIPE_TRANSPORTS = ("tensor", "disk")


class WeightPusher:
    def __init__(self, engines: Sequence[Any], transport: str = "tensor", bucket_bytes: int = 512 << 20,
                 keep_cuda_graphs: bool = False) -> None:
        if transport not in RECIPE_TRANSPORTS:
            raise ValueError(f"recipes push weights by {' or '.join(RECIPE_TRANSPORTS)} (CUDA IPC or shared "
                             f"memory, or a safetensors directory); got transport {transport!r}")
        self.engines = list(engines)
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.keep_cuda_graphs = keep_cuda_graphs
        self.last_push_bytes = 0
        self._adapter_loaded = False

    def push(self, trainer: Any, version: str) -> float:
        """Every bucket of the trainer's weights (or its LoRA adapter) to every engine -> seconds taken."""
        start = time.perf_counter()
        lora = getattr(trainer.policy, "lora", None)
        if lora is not None:
            self.last_push_bytes = push_adapter(self.engines, lora, version, replace=self._adapter_loaded)
            self._adapter_loaded = True
            return time.perf_counter() - start
        runs = trainer.weight_buckets(self.bucket_bytes)
        self.last_push_bytes = 0
        if isinstance(runs, (list, tuple)):
            self.last_push_bytes = sum(t.numel() * t.element_size() for run in runs for _, t in run)
        push_to_engines(self.engines, runs, version, self.transport, "retract", self.bucket_bytes)
        return time.perf_counter() - start

    def colocated(self, train: Callable[[], T], trainer: Any, version: str) -> tuple[T, ColocatePhases]:
        """release -> train -> resume weights -> push -> resume KV; -> (train's result, phase times).
        Every engine gets its memory back even when training or the push fails. LoRA RL keeps the
        engines' weights (the frozen base) resident: only the adapter is pushed."""
        keep_weights = getattr(trainer.policy, "lora", None) is not None
        return colocated_step(self.engines, train, lambda: self.push(trainer, version), self.keep_cuda_graphs,
                              keep_weights)
