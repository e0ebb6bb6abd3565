"""RayClient: the EngineClient verbs over a Ray engine actor (engine_client/engine_actor.py).

Synchronous verbs wait on the actor's reply (`ray.get`); `async_generate` awaits the ObjectRef,
so many generates are in flight at once from one event loop (RolloutManager's). Tensor updates
travel by reference, chosen by `tensor_transport`:
- "ray": the tensors themselves through Ray's object store (CPU tensors; shared memory on one
  node). An ObjectRef from `ray.put` also goes as it is, so one copy reaches several engines.
- "ipc": `weight_sync.cuda_ipc.serialize` bytes: CUDA IPC handles for a colocated trainer on the
  GPU (no copy), shared-memory descriptors on the CPU. The caller keeps the tensors alive until
  the call returns.
- "auto" (default): "ipc" when any tensor is on a GPU, else "ray".
"""

from __future__ import annotations

from typing import Any

from engine_client.client import EngineClient

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


class RayClient(EngineClient):
    def __init__(self, actor: Any, tensor_transport: str = "auto", owns: bool = False) -> None:
        """actor: an EngineActor handle; owns=True: close() shuts its engine down and ends it."""
        if tensor_transport not in TENSOR_TRANSPORTS:
            raise ValueError(f"tensor_transport must be one of {', '.join(TENSOR_TRANSPORTS)}; "
                             f"got {tensor_transport!r}")
        self.actor = actor
        self.tensor_transport = tensor_transport
        self.owns = owns

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

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=-1, top_logprobs_num=0, rid=None, logprob_distribution=None,
                 token_ids_logprob=None):
        return self._get(self.actor.generate.remote(prompt, sampling_params, input_ids, return_logprob,
                                                    logprob_start_len, top_logprobs_num, rid, logprob_distribution,
                                                    token_ids_logprob))

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=-1, top_logprobs_num=0, rid=None, logprob_distribution=None,
                             token_ids_logprob=None):
        return await self._await(self.actor.generate.remote(prompt, sampling_params, input_ids, return_logprob,
                                                            logprob_start_len, top_logprobs_num, rid,
                                                            logprob_distribution, token_ids_logprob))

    def abort_request(self, rid=None, abort_all=False):
        self._get(self.actor.abort_request.remote(rid, abort_all))

    async def async_abort_request(self, rid=None, abort_all=False):
        await self._await(self.actor.abort_request.remote(rid, abort_all))

    def flush_cache(self):
        return self._get(self.actor.flush_cache.remote())

    # ---- pause and weights ---------------------------------------------------------------------
    def pause_generation(self, mode="abort"):
        self._get(self.actor.pause_generation.remote(mode))

    def continue_generation(self):
        self._get(self.actor.continue_generation.remote())

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
        payload = self.tensor_payload(named_tensors)
        return self._get(self.actor.update_weights_from_tensor.remote(payload, load_format, flush_cache,
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

    def update_weights_from_disk(self, model_path, load_format=None, weight_version=None, flush_cache=True):
        return self._get(self.actor.update_weights_from_disk.remote(str(model_path), load_format, weight_version,
                                                                    flush_cache))

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl", timeout_s=30.0):
        return self._get(self.actor.init_weights_update_group.remote(master_address, master_port, rank_offset,
                                                                     world_size, group_name, backend, timeout_s))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, weight_version=None, load_format=None):
        return self._get(self.actor.update_weights_from_distributed.remote(
            list(names), [str(d).removeprefix("torch.") for d in dtypes], [list(s) for s in shapes],
            group_name, flush_cache, weight_version, load_format))

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        return self._get(self.actor.destroy_weights_update_group.remote(group_name))

    def release_memory_occupation(self, tags=None):
        return self._get(self.actor.release_memory_occupation.remote(tags))

    def resume_memory_occupation(self, tags=None):
        return self._get(self.actor.resume_memory_occupation.remote(tags))

    # ---- state ---------------------------------------------------------------------------------
    def get_weight_version(self):
        return self._get(self.actor.get_weight_version.remote())

    def health(self):
        import ray

        try:
            return bool(ray.get(self.actor.health.remote(), timeout=30))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def get_server_info(self):
        return self._get(self.actor.get_server_info.remote())

    def close(self, timeout_s: float = 30.0):
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
