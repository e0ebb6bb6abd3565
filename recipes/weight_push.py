"""WeightPusher: the trainer's new weights into every engine, once per step.

Buckets come from the trainer (ZeRO-3 gathers one bucket of full parameters at a time), and each
bucket goes to every engine at once through trainer_bridge.sync.push_weights (pause, load, flush
+ version, continue). Colocated on one GPU, `colocated` wraps the train step: engines release
their memory, the trainer steps in it, weights come back and are pushed, then the KV cache.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from trainer_bridge.colocate import KV_TAGS, WEIGHT_TAGS, ColocateError
from trainer_bridge.sync import push_weights

T = TypeVar("T")
RECIPE_TRANSPORTS = ("tensor", "disk")


class WeightPusher:
    def __init__(self, engines: Sequence[Any], transport: str = "tensor", bucket_bytes: int = 512 << 20) -> None:
        if transport not in RECIPE_TRANSPORTS:
            raise ValueError(f"recipes push weights by {' or '.join(RECIPE_TRANSPORTS)} (CUDA IPC or shared "
                             f"memory, or a safetensors directory); got transport {transport!r}")
        self.engines = list(engines)
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self._pool = ThreadPoolExecutor(max_workers=max(len(self.engines), 1), thread_name_prefix="push")

    def push(self, trainer: Any, version: str) -> float:
        """Every bucket of the trainer's weights to every engine -> seconds taken."""
        start = time.perf_counter()
        for bucket in trainer.weight_buckets(self.bucket_bytes):
            self._on_all(lambda e: push_weights(e, bucket, version, self.transport, "retract", self.bucket_bytes))
        return time.perf_counter() - start

    def colocated(self, train: Callable[[], T], trainer: Any, version: str) -> tuple[T, float]:
        """release -> train -> resume weights -> push -> resume KV; -> (train's result, push s).
        Every engine gets its memory back even when training or the push fails."""
        resumed: list[str] = []
        try:
            self._on_all(lambda e: _memory(e.release_memory_occupation, None, "release"))
            result = train()
            self._on_all(lambda e: _memory(e.resume_memory_occupation, WEIGHT_TAGS, "resume"))
            resumed += WEIGHT_TAGS
            seconds = self.push(trainer, version)
        finally:
            missing = [tag for tag in WEIGHT_TAGS + KV_TAGS if tag not in resumed]
            self._on_all(lambda e: _memory(e.resume_memory_occupation, missing, "resume"))
        return result, seconds

    def _on_all(self, fn: Callable[[Any], Any]) -> None:
        futures = [self._pool.submit(fn, e) for e in self.engines]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _memory(verb: Callable, tags: Any, what: str) -> None:
    ok, message = verb(tags)
    if not ok:
        raise ColocateError(f"engine refused to {what} memory {tags or 'all'}: {message}")
