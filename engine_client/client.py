"""EngineClient: the verbs RL code needs from one engine, wherever the engine runs.

RolloutManager, trainer_bridge.sync.push_weights and the colocation choreography talk to engines
only through these verbs, so the same RL code drives an Engine in this process
(`InProcessClient`), a `tandem serve` (or SGLang) server over SGLang's HTTP routes (`HttpClient`)
or a Ray engine actor (`RayClient`, engine_client/engine_actor.py). Method names and replies are
Engine's (SGLang's): generate returns the same dicts, weight updates return (success, message).

Tensor payloads by reference: HttpClient and RayClient(tensor_transport="ipc") send
`weight_sync.cuda_ipc.serialize` payloads (CUDA IPC handles on a GPU, shared-memory descriptors
on the CPU), so the sender must keep the tensors alive until the call returns, as in SGLang.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

Reply = tuple[bool, str]


class EngineClient:
    """The verbs; each implementation forwards them to its engine. Replies are Engine's."""

    def generate(self, prompt: Union[str, list[str], None] = None, sampling_params: Any = None,
                 input_ids: Any = None, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, rid: Any = None,
                 logprob_distribution: Optional[str] = None, token_ids_logprob: Any = None) -> Union[dict, list[dict]]:
        """Engine.generate's dicts. logprob_distribution: "original" or "processed" (DESIGN
        section 3); None: the engine's default. token_ids_logprob: SGLang's ids whose logprobs
        come back at every position (one list, or one per prompt)."""
        raise NotImplementedError

    async def async_generate(self, prompt: Union[str, list[str], None] = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, rid: Any = None,
                             logprob_distribution: Optional[str] = None,
                             token_ids_logprob: Any = None) -> Union[dict, list[dict]]:
        raise NotImplementedError

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """End request `rid` (each of a group's n samples has its own rid: `{rid}-{i}`) or all."""
        raise NotImplementedError

    async def async_abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """abort_request from an event loop (by default on a thread, so the loop keeps running)."""
        await asyncio.to_thread(self.abort_request, rid, abort_all)

    def flush_cache(self) -> bool:
        raise NotImplementedError

    def pause_generation(self, mode: str = "abort") -> None:
        raise NotImplementedError

    def continue_generation(self) -> None:
        raise NotImplementedError

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None) -> Reply:
        raise NotImplementedError

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True) -> Reply:
        raise NotImplementedError

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 30.0) -> Reply:
        """timeout_s bounds the rendezvous and every broadcast of the group afterwards."""
        raise NotImplementedError

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None,
                                        load_format: Optional[str] = None) -> Reply:
        raise NotImplementedError

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Reply:
        raise NotImplementedError

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> Reply:
        raise NotImplementedError

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> Reply:
        raise NotImplementedError

    def get_weight_version(self) -> str:
        raise NotImplementedError

    def health(self) -> bool:
        """True while the engine answers and its core is alive."""
        raise NotImplementedError

    def get_server_info(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of the connection (the engine itself keeps running unless this client owns it)."""


class InProcessClient(EngineClient):
    """An Engine in this process. `owns=True`: close() shuts the engine down."""

    def __init__(self, engine: Any, owns: bool = False) -> None:
        self.engine = engine
        self.owns = owns

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=-1, top_logprobs_num=0, rid=None, logprob_distribution=None,
                 token_ids_logprob=None):
        return self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num, rid=rid,
                                    logprob_distribution=logprob_distribution, token_ids_logprob=token_ids_logprob)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=-1, top_logprobs_num=0, rid=None, logprob_distribution=None,
                             token_ids_logprob=None):
        return await self.engine.async_generate(prompt=prompt, sampling_params=sampling_params,
                                                input_ids=input_ids, return_logprob=return_logprob,
                                                logprob_start_len=logprob_start_len,
                                                top_logprobs_num=top_logprobs_num, rid=rid,
                                                logprob_distribution=logprob_distribution,
                                                token_ids_logprob=token_ids_logprob)

    def abort_request(self, rid=None, abort_all=False):
        self.engine.abort_request(rid, abort_all=abort_all)

    async def async_abort_request(self, rid=None, abort_all=False):
        self.engine.abort_request(rid, abort_all=abort_all)  # a message to the core: never blocks

    def flush_cache(self):
        return self.engine.flush_cache()

    def pause_generation(self, mode="abort"):
        self.engine.pause_generation(mode)

    def continue_generation(self):
        self.engine.continue_generation()

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
        return self.engine.update_weights_from_tensor(named_tensors, load_format, flush_cache, weight_version)

    def update_weights_from_disk(self, model_path, load_format=None, weight_version=None, flush_cache=True):
        return self.engine.update_weights_from_disk(model_path, load_format, weight_version, flush_cache)

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl", timeout_s=30.0):
        return self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                                     group_name, backend, timeout_s)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, weight_version=None, load_format=None):
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache,
                                                           weight_version, load_format)

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        return self.engine.destroy_weights_update_group(group_name)

    def release_memory_occupation(self, tags=None):
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None):
        return self.engine.resume_memory_occupation(tags)

    def get_weight_version(self):
        return self.engine.get_weight_version()

    def health(self):
        return bool(self.engine.is_alive())

    def get_server_info(self):
        return self.engine.get_server_info()

    def close(self):
        if self.owns:
            self.engine.shutdown()


def as_client(engine: Any) -> EngineClient:
    """An EngineClient as it is, an Engine wrapped in an InProcessClient."""
    if isinstance(engine, EngineClient):
        return engine
    if hasattr(engine, "async_generate") and hasattr(engine, "abort_request"):
        return InProcessClient(engine)
    raise TypeError(f"expected an EngineClient or an Engine, got {type(engine).__name__}")


def generate_body(prompt: Any, sampling_params: Any, input_ids: Any, return_logprob: bool,
                  logprob_start_len: int, top_logprobs_num: int, rid: Any,
                  logprob_distribution: Optional[str] = None, token_ids_logprob: Any = None) -> dict:
    """SGLang's /generate body (unset fields left out, as SGLang's own clients do)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt (text) and input_ids")
    body: dict[str, Any] = {"text": prompt} if prompt is not None else {"input_ids": input_ids}
    body.update(sampling_params=sampling_params or {}, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
    if rid is not None:
        body["rid"] = rid
    if logprob_distribution is not None:
        body["logprob_distribution"] = logprob_distribution
    if token_ids_logprob is not None:
        body["token_ids_logprob"] = token_ids_logprob
    return body


def __getattr__(name: str) -> Any:
    """HttpClient and RayClient live in their own modules (httpx, ray imported there)."""
    if name == "HttpClient":
        from engine_client.http_client import HttpClient

        return HttpClient
    if name == "RayClient":
        from engine_client.ray_client import RayClient

        return RayClient
    raise AttributeError(f"module 'engine_client.client' has no attribute {name!r}")
