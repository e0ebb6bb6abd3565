"""A trainer process that forms its weight group as slime's `init_process_group` (and SGLang's
`init_custom_process_group`) does, then broadcasts a checkpoint: the other end of the CPU tests
in tests/engine/test_weight_update_distributed.py. Run as a script:

    python slime_trainer.py PORT WORLD_SIZE GROUP_NAME MODEL_DIR SEND [BUCKET_BYTES]

SEND: "tensors" (one broadcast per tensor, async then waited, as slime sends), "buckets" (one
broadcast per flattened bucket of at most BUCKET_BYTES), "one-then-hang" (the first tensor, then
nothing: killed mid-update), "silent" (joins, never sends). It prints "listening" just before it hosts the rendezvous, "joined" and the bucket
layout as JSON ({"buckets": [[name, ...], ...]}) once the group formed, "done" at the end.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def slime_init_process_group(init_method: str, world_size: int, rank: int, group_name: str,
                             backend: str = "gloo", timeout_s: float = 60.0):
    """The sequence of slime.utils.distributed_utils.init_process_group: torch's rendezvous for
    the tcp:// address (a TCPStore, rank 0 hosting it, waiting for every worker), the store's
    timeout, a PrefixStore named after the group, then torch's own process-group helper, and the
    identity rank map registered for the group."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **options)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def buckets_of(named: list, bucket_bytes: int) -> list[list]:
    buckets, size = [[]], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return buckets


def main(argv: list[str]) -> None:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files
    from weight_sync.bucket import FlattenedBucket

    port, world_size, group_name, model_dir, send = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    bucket_bytes = int(argv[5]) if len(argv) > 5 else 64 << 10
    named = [kv for path in safetensors_files(model_dir) for kv in load_file(path).items()]
    print("listening", flush=True)  # the store binds next: a joiner with a short timeout may start now
    pg = slime_init_process_group(f"tcp://127.0.0.1:{port}", world_size, 0, group_name)
    buckets = buckets_of(named, bucket_bytes)
    print("joined", json.dumps({"buckets": [[n for n, _ in b] for b in buckets]}), flush=True)
    if send == "tensors":
        handles = [dist.broadcast(t.contiguous(), 0, group=pg, async_op=True) for _, t in named]
        for handle in handles:
            handle.wait()
    elif send == "buckets":
        for bucket in buckets:
            dist.broadcast(FlattenedBucket.pack(bucket).flattened_tensor, 0, group=pg)
    elif send == "one-then-hang":
        dist.broadcast(named[0][1].contiguous(), 0, group=pg)
        print("sent one", flush=True)
        time.sleep(600)
    elif send == "silent":
        time.sleep(600)
    print("done", flush=True)
    os._exit(0)  # skip the group's teardown at exit: the test is over, its peers may be gone


if __name__ == "__main__":
    main(sys.argv[1:])
