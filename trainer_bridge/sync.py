"""push_weights: the trainer's side of a weight update (DESIGN section 5), one call per step.

pause (retract by default: running requests resume on the new weights, their KV recomputed) ->
buckets of at most `bucket_bytes` through the chosen transport -> the last bucket flushes the
radix cache and sets the weight version -> continue, in a `finally`: an engine is never left
paused. A refused bucket raises WeightSyncError with the engine's message; the version is then
not bumped, and buckets before it stay loaded, so the caller retries the whole push.
pause_mode "in_place" keeps running requests and their KV, so it cannot flush: the prefix cache
keeps old-weight KV too (flush it once those requests finish); "abort" ends them.

Transports ("tensor": FlattenedBucket payloads, in-process or by reference on one machine;
"distributed": a broadcast from this trainer, rank 0 of `group`; "disk": a safetensors directory)
all take engine parameter names or HF names (Policy.model.named_parameters() gives the former).
"""

from __future__ import annotations

import tempfile
import threading
from typing import Any, Iterable, Iterator, Optional

import torch

TRANSPORTS = ("tensor", "distributed", "disk")


class WeightSyncError(RuntimeError):
    pass


def push_weights(engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str,
                 transport: str = "tensor", pause_mode: str = "retract", bucket_bytes: int = 512 << 20,
                 group: Any = None, group_name: str = "weight_update_group") -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if transport == "distributed" and group is None:
        raise ValueError("transport 'distributed' needs group: this trainer's weight_sync.nccl.WeightGroup (rank 0)")
    named = [(name, t.detach()) for name, t in named_tensors]
    flush = pause_mode != "in_place"  # in_place keeps running requests' KV, so the cache cannot flush
    try:
        engine.pause_generation(pause_mode)
        if transport == "disk":
            _check(*_via_disk(engine, named, weight_version, flush))
            return
        buckets = list(_buckets(named, bucket_bytes))
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            version = weight_version if last else None
            if transport == "tensor":
                _check(*_via_tensor(engine, bucket, last and flush, version))
            else:
                _check(*_via_broadcast(engine, bucket, last and flush, version, group, group_name))
    finally:
        engine.continue_generation()


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


def _via_tensor(engine: Any, bucket: list, last: bool, version: Optional[str]) -> tuple[bool, str]:
    from weight_sync.bucket import FlattenedBucket

    payload = FlattenedBucket.pack(bucket).to_payload()
    return engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=last,
                                             weight_version=version)


def _via_broadcast(engine: Any, bucket: list, last: bool, version: Optional[str], group: Any,
                   group_name: str) -> tuple[bool, str]:
    """The engine receives (blocking) while this trainer sends: the engine call runs beside it."""
    reply: list = []
    names = [n for n, _ in bucket]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
    shapes = [list(t.shape) for _, t in bucket]
    receiver = threading.Thread(target=lambda: reply.append(engine.update_weights_from_distributed(
        names, dtypes, shapes, group_name, flush_cache=last, weight_version=version)))
    receiver.start()
    for _, t in bucket:
        group.broadcast(t.contiguous(), src=0)
    receiver.join()
    return reply[0] if reply else (False, "the engine's receive call raised (see its log)")


def _via_disk(engine: Any, named: list, version: str, flush: bool) -> tuple[bool, str]:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="tandem-weights-") as path:
        save_file({n: t.contiguous().cpu() for n, t in named}, f"{path}/model.safetensors")
        return engine.update_weights_from_disk(path, weight_version=version, flush_cache=flush)
