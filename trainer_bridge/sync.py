"""push_weights: the trainer's side of a weight update (DESIGN section 5), one call per step.

pause (retract by default: running requests resume on the new weights, their KV recomputed) ->
buckets of at most `bucket_bytes` through the chosen transport -> the last bucket flushes the
radix cache and sets the weight version -> continue, in a `finally`: an engine is never left
paused. A refused bucket raises WeightSyncError with the engine's message; the version is then
not bumped, and buckets before it stay loaded, so the caller retries the whole push.
pause_mode "in_place" keeps running requests and their KV, so it cannot flush: the prefix cache
keeps old-weight KV too (flush it once those requests finish); "abort" ends them.

Transports are weight_sync's WeightSenders, picked by name ("tensor": FlattenedBucket payloads,
in-process or by reference on one machine, weight_sync/tensor.py; "distributed": a broadcast from
this trainer, rank 0 of `group`, weight_sync/nccl.py; "disk": a safetensors directory,
weight_sync/disk.py); all take engine parameter names or HF names (Policy.model.named_parameters()
gives the former).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch

from weight_sync.base import WeightSyncError, on_all_engines, sender_for, transports
from weight_sync.bucket import split_by_bytes

TRANSPORTS = transports()  # the registered WeightSenders' names
__all__ = ["TRANSPORTS", "WeightSyncError", "on_all_engines", "push_to_engines", "push_weights", "split_by_bytes"]


def push_weights(engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str,
                 transport: str = "tensor", pause_mode: str = "retract", bucket_bytes: int = 512 << 20,
                 group: Any = None, group_name: str = "weight_update_group") -> None:
    """One engine, one list of (name, tensor): see push_to_engines."""
    push_to_engines([engine], [list(named_tensors)], weight_version, transport, pause_mode, bucket_bytes,
                    group, group_name)


def push_to_engines(engines: Sequence[Any], trainer_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
                    weight_version: str, transport: str = "tensor", pause_mode: str = "retract",
                    bucket_bytes: int = 512 << 20, group: Any = None,
                    group_name: str = "weight_update_group") -> None:
    """Every engine paused once for the whole update. trainer_buckets: runs of full parameters as
    the trainer hands them out, each valid until the next is drawn (ZeRO-3 gathers one at a time);
    each is cut into buckets of at most bucket_bytes and sent to every engine before the next is
    drawn. The last bucket flushes and sets the version; when the trainer's runs come from a
    generator (the last is only known once it ends), an empty closing bucket does that."""
    sender = sender_for(transport, group=group, group_name=group_name)
    flush = pause_mode != "in_place"  # in_place keeps running requests' KV, so the cache cannot flush
    send = lambda bucket, last: sender.send_all(  # noqa: E731
        engines, bucket, last and flush, weight_version if last else None)
    try:
        on_all_engines(engines, lambda e: e.pause_generation(pause_mode))
        if sender.bucketed:
            _send_buckets(trainer_buckets, bucket_bytes, send)
        else:  # the whole update in one send (a checkpoint): host copies, since runs expire
            send([(n, t.detach().cpu()) for run in trainer_buckets for n, t in run], True)
    finally:
        try:  # a bucket still on the wire (the trainer's runs raised mid-way) lands before continuing
            sender.close()
        finally:
            on_all_engines(engines, lambda e: e.continue_generation())
            release_shared_buckets()


def _send_buckets(trainer_buckets: Iterable[Sequence], bucket_bytes: int, send: Callable[[list, bool], None]) -> None:
    runs = trainer_buckets if isinstance(trainer_buckets, (list, tuple)) else None
    if runs is None:  # a generator: the last run is unknown until it ends
        for run in trainer_buckets:
            for bucket in split_by_bytes([(n, t.detach()) for n, t in run], bucket_bytes):
                send(bucket, False)
        send([], True)
        return
    cut = [bucket for run in runs for bucket in split_by_bytes([(n, t.detach()) for n, t in run], bucket_bytes)]
    cut = cut or [[]]
    for i, bucket in enumerate(cut):
        send(bucket, i == len(cut) - 1)


def release_shared_buckets() -> None:
    """CUDA blocks sent by IPC stay reserved until the receivers let go and this process
    collects them: without it every push would keep its buckets (memory grows per update)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
