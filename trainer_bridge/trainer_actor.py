"""TrainerActor: a Ray actor holding the trainer's Policy, which pushes its weights to engines.

Placed with a fractional GPU share next to engine actors (engine_client/engine_actor.py), it runs the
colocated step (trainer_bridge.colocate): engines release their memory, the policy trains in it,
the engines take the new weights and resume. Engines are EngineActor handles (wrapped in
engine_client.ray_client.RayClient) or any EngineAPI. Weights travel as `tensor_transport` says:
"ipc" (CUDA IPC handles from this process on a GPU, shared-memory descriptors on the CPU), "ray"
(CPU tensors through Ray's object store) or "auto" (ipc for GPU tensors, ray for CPU ones); or
through a safetensors directory with `transport="disk"`.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from trainer_bridge.colocate import PushConfig, colocated_step
from trainer_bridge.sync import push_to_engines


class TrainerActor:
    """Ray turns this into an actor with `ray.remote(TrainerActor)` (see start_trainer_actor)."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu",
                 loss: Any = None, micro_batch_size: int = 64, temperature: Optional[float] = None,
                 attention_backend: Optional[str] = None, split_size: Optional[int] = None,
                 load_format: str = "auto") -> None:
        """loss: a trainer_bridge.losses.LossConfig (None: its defaults). attention_backend,
        split_size: the engine's, so trainer logprobs match rollout logprobs bit for bit.
        load_format "dummy": random weights of the config's shape (benchmarks)."""
        from trainer_bridge.losses import LossConfig
        from trainer_bridge.policy import Policy
        from trainer_bridge.trainer import TorchTrainer

        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'bfloat16', 'float32'); got {dtype!r}")
        policy = Policy.from_pretrained(model_path, getattr(torch, dtype), device, load_format,
                                        attention_backend=attention_backend, split_size=split_size)
        self.trainer = TorchTrainer(policy, loss or LossConfig(), micro_batch_size, temperature)

    def ready(self) -> bool:
        return True

    def train_step(self, samples: Sequence[Any], advantages: Sequence[float], lr: float) -> dict[str, float]:
        """One optimizer step on rollout.types.Samples with one advantage each -> metrics."""
        from trainer_bridge.rollout_batch import RolloutBatch

        return self.trainer.train_step(RolloutBatch.from_samples(samples, advantages), lr)

    def rollout_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list:
        """The policy's logprob of each response token (lists of floats), for on-policy checks."""
        with torch.no_grad():
            out = self.trainer.policy.rollout_logprobs(prompts, responses, self.trainer.temperature)
        return [t.tolist() for t in out]

    def named_weights(self, bucket_bytes: int = 512 << 20) -> list[tuple[str, torch.Tensor]]:
        """Full parameters with engine names (what a push sends)."""
        return [kv for bucket in self.trainer.weight_buckets(bucket_bytes) for kv in bucket]

    def push_weights(self, engines: Sequence[Any], weight_version: str, push: PushConfig = PushConfig(),
                     tensor_transport: str = "auto") -> float:
        """Pause -> buckets -> flush + version -> continue on every engine at once; -> seconds.
        Raises trainer_bridge.sync.WeightSyncError with the engine's reason on refusal."""
        start = time.perf_counter()
        self._push(_clients(engines, tensor_transport), weight_version, push)
        return time.perf_counter() - start

    def colocated_step(self, engines: Sequence[Any], samples: Sequence[Any], advantages: Sequence[float],
                       lr: float, weight_version: str, push: PushConfig = PushConfig(),
                       tensor_transport: str = "auto") -> tuple[dict[str, float], dict[str, float]]:
        """Release engines -> train step -> resume weights -> push -> resume KV -> continue.
        -> (train metrics, phase seconds)."""
        clients = _clients(engines, tensor_transport)
        metrics, phases = colocated_step(clients, lambda: self.train_step(samples, advantages, lr),
                                         lambda: self._push(clients, weight_version, push))
        return metrics, phases.as_dict()

    def _push(self, clients: Sequence[Any], weight_version: str, push: PushConfig) -> None:
        push_to_engines(clients, self.trainer.weight_buckets(push.bucket_bytes), weight_version,
                        push.transport, push.pause_mode, push.bucket_bytes)


def _clients(engines: Sequence[Any], tensor_transport: str) -> list[Any]:
    from engine_client.ray_client import as_engine

    return [as_engine(e, tensor_transport) for e in engines]


def start_trainer_actor(model_path: str, num_gpus: Optional[float] = None, num_cpus: float = 0,
                        start_timeout_s: float = 900.0, placement_group: Any = None, bundle_index: int = 0,
                        **trainer_kwargs: Any) -> Any:
    """A TrainerActor on `num_gpus` of a GPU (fractional: beside engine actors on the same GPU;
    None: 1 when device is not 'cpu', else 0), ready when this returns. placement_group /
    bundle_index: a engine_client.engine_actor.colocation_group bundle, to share that engine's GPU."""
    from engine_client.engine_actor import ensure_ray, in_bundle, wait_until_ready

    ensure_ray()
    import ray

    if num_gpus is None:
        num_gpus = 0 if trainer_kwargs.get("device", "cpu") == "cpu" else 1
    options = {"num_gpus": num_gpus, "num_cpus": num_cpus, **in_bundle(placement_group, bundle_index)}
    actor = ray.remote(TrainerActor).options(**options).remote(model_path, **trainer_kwargs)
    wait_until_ready([actor.ready.remote()], [actor], start_timeout_s, f"a trainer actor with num_gpus={num_gpus}")
    return actor
