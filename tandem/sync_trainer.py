"""The trainer side of `tandem bench-sync`: a model's weights in flattened buckets, sent by reference.

BucketTrainer holds random weights of a checkpoint's shapes (HF names, from its config on the
meta device) directly in flattened bucket buffers, as trainers with contiguous parameter buffers
do, so it holds one copy and every update reuses the same buffers: one CUDA IPC handle (or one
shared-memory file on the CPU) per bucket, the same handles each time, which keeps GPU memory
flat over hundreds of updates. `ipc_collect` frees what the engine has closed.

It runs in another process: a Ray actor when Ray is installed (fractional GPU, so it shares the
engine's GPU) or a spawned process driven over a pipe (TrainerProcess); both expose the same calls.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch

from engine.testing.checkpoint_shapes import hf_parameter_shapes


class BucketTrainer:
    def __init__(self, model_path: str, dtype: str, device: str, bucket_bytes: int, seed: int = 0) -> None:
        from weight_sync.bucket import FlattenedBucket, split_by_bytes

        self.dtype, self.device = getattr(torch, dtype), torch.device(device)
        gen = torch.Generator(self.device).manual_seed(seed)
        itemsize = self.dtype.itemsize
        self.buckets = []
        shapes = hf_parameter_shapes(model_path)
        for group in split_by_bytes(shapes, bucket_bytes, lambda shape: shape.numel() * itemsize):
            bucket = FlattenedBucket.empty([(name, shape, self.dtype) for name, shape in group], self.device)
            bucket.flattened_tensor.view(self.dtype).normal_(0.0, 0.02, generator=gen)  # the "trained" weights
            self.buckets.append(bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def layout(self) -> dict[str, Any]:
        return {"num_buckets": len(self.buckets),
                "total_bytes": sum(b.flattened_tensor.numel() for b in self.buckets),
                "num_tensors": sum(len(b.metadata) for b in self.buckets)}

    def payloads(self) -> list[str]:
        """One base64 payload per bucket: references to the same buffers every update."""
        from weight_sync.cuda_ipc import serialize

        return [serialize(b.to_payload(), as_text=True) for b in self.buckets]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [pair for b in self.buckets for pair in b.unpack()]

    def tensor_names(self) -> list[str]:
        return [m.name for b in self.buckets for m in b.metadata]

    def first_rows(self, name: str, rows: int) -> list:
        tensor = dict(self.named_tensors())[name]
        return tensor[:rows].float().cpu().tolist()

    def ipc_collect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


def _serve(conn: Any, trainer_cls: type, kwargs: dict) -> None:
    trainer = trainer_cls(**kwargs)
    conn.send(trainer.layout())
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(None)
            return
        conn.send(getattr(trainer, method)(*args))


class TrainerProcess:
    """A trainer (BucketTrainer, or tandem/lora_sync_trainer.py's LoRATrainer) in a spawned process,
    driven over a pipe (the calls Ray's actor would take)."""

    def __init__(self, trainer_cls: type = BucketTrainer, **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, trainer_cls, kwargs), daemon=True)
        self._process.start()
        self.layout = self._conn.recv()

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._conn.recv()

    def stop(self) -> None:
        self.call("stop")
        self._process.join(30)


class TrainerActor:
    """A trainer as a Ray actor sharing the engine's GPU (num_gpus < 1)."""

    def __init__(self, num_gpus: float, trainer_cls: type = BucketTrainer, **kwargs: Any) -> None:
        import ray

        ray.init(ignore_reinit_error=True, log_to_driver=False)
        self._ray = ray
        self._actor = ray.remote(num_gpus=num_gpus)(trainer_cls).remote(**kwargs)
        self.layout = ray.get(self._actor.layout.remote())

    def call(self, method: str, *args: Any) -> Any:
        return self._ray.get(getattr(self._actor, method).remote(*args))

    def stop(self) -> None:
        self._ray.kill(self._actor)
