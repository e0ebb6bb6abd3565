"""RayClient: the EngineAPI over a Ray engine actor (engine_client/engine_actor.py).

Every Engine method is forwarded by name: `client.flush_cache()` is
`ray.get(actor.call.remote("flush_cache"))`, and `await client.async_generate(...)` awaits the
ObjectRef, so many generates are in flight at once from one event loop (RolloutManager's). A
method added to Engine is reached with no edit here. Written out are only what Ray itself needs:
tensor packing, a bounded health probe, close, and a dead actor's one-line error.
Tensor updates travel by reference, chosen by `tensor_transport`:
- "ray": the tensors themselves through Ray's object store (CPU tensors; shared memory on one
  node). An ObjectRef from `ray.put` also goes as it is, so one copy reaches several engines.
- "ipc": `weight_sync.cuda_ipc.serialize` bytes (unpickled by the engine's core): CUDA
  IPC handles for a colocated trainer on the GPU (no copy), shared-memory descriptors on the CPU.
  The caller keeps the tensors alive until the call returns.
- "auto" (default): "ipc" when any tensor is on a GPU, else "ray".
"""

from __future__ import annotations

from typing import Any, Callable

from engine.api.protocol import Reply

TENSOR_TRANSPORTS = ("auto", "ray", "ipc")


class EngineDied(ConnectionError):
    """The engine actor's process is gone (killed, out of memory, crashed): every call to it fails
    with this one-line reason instead of Ray's multi-line ActorDiedError."""

    @classmethod
    def from_ray(cls, exc: Exception) -> "EngineDied":
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if line.startswith("The actor is dead")), lines[0] if lines else "")
        reason = reason.split(" Some common causes")[0]
        actor = (getattr(exc, "actor_id", None) or "?")[:8]
        return cls(f"engine actor {actor} died: {reason} (killed, out of memory or a crash: the Ray logs under "
                   f"/tmp/ray/session_latest/logs say which)")


class RayClient:
    def __init__(self, actor: Any, tensor_transport: str = "auto", owns: bool = False) -> None:
        """actor: an EngineActor handle; owns=True: close() shuts its engine down and ends it."""
        if tensor_transport not in TENSOR_TRANSPORTS:
            raise ValueError(f"tensor_transport must be one of {', '.join(TENSOR_TRANSPORTS)}; "
                             f"got {tensor_transport!r}")
        self.actor = actor
        self.tensor_transport = tensor_transport
        self.owns = owns

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Any other public name: a forwarder to the actor's Engine method of that name."""
        if name.startswith("_") or "actor" not in self.__dict__:  # dunders, and while unpickling
            raise AttributeError(name)
        if name.startswith("async_"):
            async def forward(*args: Any, **kwargs: Any) -> Any:
                return await self._await(self.actor.call.remote(name, *args, **kwargs))
        else:
            def forward(*args: Any, **kwargs: Any) -> Any:
                return self._get(self.actor.call.remote(name, *args, **kwargs))
        forward.__name__ = forward.__qualname__ = name
        return forward

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.ActorDiedError as exc:
            raise EngineDied.from_ray(exc) from exc

    async def _await(self, ref: Any) -> Any:
        import ray

        try:
            return await ref
        except ray.exceptions.ActorDiedError as exc:
            raise EngineDied.from_ray(exc) from exc

    # ---- what Ray needs written out ------------------------------------------------------------
    def update_weights_from_tensor(self, named_tensors: Any, load_format: Any = None, flush_cache: bool = True,
                                   weight_version: Any = None) -> Reply:
        payload = self.tensor_payload(named_tensors)
        # Engine.update_weights_from_tensor takes pairs, a bucket or their serialized bytes alike
        return self._get(self.actor.call.remote("update_weights_from_tensor", payload, load_format, flush_cache,
                                                weight_version))

    def tensor_payload(self, named_tensors: Any) -> Any:
        """What goes to the actor for this client's tensor_transport (see the module doc)."""
        transport = self.tensor_transport
        if transport == "auto":
            transport = "ipc" if any(t.is_cuda for t in _tensors_of(named_tensors)) else "ray"
        if transport == "ray" or isinstance(named_tensors, (bytes, str)):
            return named_tensors
        from weight_sync.cuda_ipc import serialize

        return serialize(named_tensors)

    def health(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.actor.call.remote("health"), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down and end the actor; an actor that does not answer within timeout_s
        (or died) is killed all the same, so closing never hangs on it."""
        if self.owns:
            import ray

            try:
                ray.get(self.actor.shutdown.remote(), timeout=timeout_s)
            except ray.exceptions.ActorDiedError:
                pass  # nothing left to shut down
            finally:
                ray.kill(self.actor)


def as_engine(engine: Any, tensor_transport: str = "auto") -> Any:
    """An EngineAPI as it is; a Ray engine actor's handle wrapped in a RayClient."""
    import ray

    return RayClient(engine, tensor_transport) if isinstance(engine, ray.actor.ActorHandle) else engine


def _tensors_of(payload: Any) -> list:
    """The tensors of [(name, tensor)], a flattened-bucket dict or a FlattenedBucket."""
    import torch

    if isinstance(payload, dict):
        payload = [(None, payload.get("flattened_tensor"))]
    elif hasattr(payload, "flattened_tensor"):
        payload = [(None, payload.flattened_tensor)]
    elif not isinstance(payload, (list, tuple)):
        return []
    return [item[1] for item in payload
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)]
