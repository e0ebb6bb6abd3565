"""push_weights: the trainer's side of a weight update (DESIGN section 5), one call per step.

pause (retract by default: running requests resume on the new weights, their KV recomputed) ->
buckets of at most `bucket_bytes` through the chosen transport -> the last bucket flushes the
radix cache and sets the weight version -> continue, in a `finally`: an engine is never left
paused. A refused bucket raises WeightSyncError with the engine's message; the version is then
not bumped, and buckets before it stay loaded, so the caller retries the whole push.
pause_mode "in_place" keeps running requests and their KV, so it cannot flush: the prefix cache
keeps old-weight KV too (flush it once those requests finish); "abort" ends them.

Transports are weight_sync's WeightSenders, picked by name ("tensor": FlattenedBucket payloads,
in-process or by reference on one machine, weight_sync/bucket.py; "distributed": a broadcast from
this trainer, rank 0 of `group`, weight_sync/nccl.py; "disk": a safetensors directory,
weight_sync/disk.py); all take engine parameter names or HF names (Policy.model.named_parameters()
gives the former).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from weight_sync.base import sender_for, transports

TRANSPORTS = transports()  # the registered WeightSenders' names


class WeightSyncError(RuntimeError):
    pass


def push_weights(engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str,
                 transport: str = "tensor", pause_mode: str = "retract", bucket_bytes: int = 512 << 20,
                 group: Any = None, group_name: str = "weight_update_group") -> None:
    sender = sender_for(transport, group=group, group_name=group_name)
    named = [(name, t.detach()) for name, t in named_tensors]
    flush = pause_mode != "in_place"  # in_place keeps running requests' KV, so the cache cannot flush
    try:
        engine.pause_generation(pause_mode)
        buckets = list(_buckets(named, bucket_bytes)) if sender.bucketed else [named]
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            _check(*sender.send(engine, bucket, last and flush, weight_version if last else None))
    finally:
        engine.continue_generation()
        release_shared_buckets()


def release_shared_buckets() -> None:
    """CUDA blocks sent by IPC stay reserved until the receivers let go and this process
    collects them: without it every push would keep its buckets (memory grows per update)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise WeightSyncError(f"engine refused the weights: {message}")


def _buckets(named: list, bucket_bytes: int) -> Iterator[list]:
    """Consecutive runs of tensors of at most bucket_bytes (a larger tensor goes alone)."""
    bucket: list = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket or not named:
        yield bucket
