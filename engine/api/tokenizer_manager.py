"""TokenizerManagerShim: `Engine.tokenizer_manager`, for RL code that reaches past sglang.Engine
into its TokenizerManager and awaits it from its own event loop (verl's AsyncEngine and async
server, SkyRL's SGLang engine): `await engine.tokenizer_manager.update_weights_from_tensor(obj,
None)` and the like.

The request objects are SGLang's *ReqInput dataclasses, read by attribute only (no sglang import:
SGLang's own classes or any look-alike serve). Replies are SGLang's: (success, message) for weight
verbs, (success, message, num_paused_requests) for a disk update, None for memory and pause verbs,
an object with `.success` for flush_cache. Blocking Engine calls run on a worker thread, so the
caller's loop keeps delivering the outputs of its generates meanwhile. Every call reaches tandem's
own Engine method, never a subclass's override: verl's AsyncEngine overrides release_memory_occupation
and the like with coroutines that call back into this object.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

# GenerateReqInput's fields Engine.async_generate takes (text is its prompt); the refused ones
# are refused there when set (engine/api/sglang_kwargs.py)
GENERATE_FIELDS = ("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "token_ids_logprob", "stream", "rid", "lora_path", "return_routed_experts",
                   "routed_experts_start_len", "return_prompt_token_ids", "extra_key")


@dataclass
class FlushCacheReqOutput:
    success: bool


class TokenizerManagerShim:
    def __init__(self, engine: Any) -> None:
        from engine.api.engine import Engine

        # tandem's methods bound to this engine, whatever a subclass overrides
        self._engine = _BaseMethods(engine, Engine)

    @property
    def server_args(self) -> Any:
        return self._engine.server_args

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"tandem's engine.tokenizer_manager has no {name!r}: it serves only the calls RL "
                             f"frameworks make (generate_request, flush_cache, the weight and memory verbs, "
                             f"abort_request, pause/continue); call the Engine's own methods instead")

    # ---- generation ----------------------------------------------------------------------------
    async def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[dict]:
        """A GenerateReqInput -> an async generator: the final dict(s), or each chunk with stream."""
        from engine.api.sglang_kwargs import DP_RANKS, REFUSED

        kwargs = {name: getattr(obj, name) for name in (*GENERATE_FIELDS, *REFUSED, *DP_RANKS)
                  if getattr(obj, name, None) is not None}
        stream = self._engine.async_generate(prompt=getattr(obj, "text", None), **kwargs)
        if not kwargs.get("stream"):
            yield await stream
            return
        try:
            async for chunk in stream:
                yield chunk
        finally:  # closed early (aclose, or the caller's task cancelled): nothing decodes for nobody
            for rid in list(stream.pending):
                self._engine.abort_request(rid)
            stream.close()

    def abort_request(self, rid: str = "", abort_all: bool = False, prefix: bool = False, **_: Any) -> None:
        self._engine.abort_request(rid or None, abort_all, prefix)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return FlushCacheReqOutput(bool(await asyncio.to_thread(self._engine.flush_cache)))

    async def pause_generation(self, obj: Any = None) -> None:
        await asyncio.to_thread(self._engine.pause_generation, getattr(obj, "mode", "abort"))

    async def continue_generation(self, obj: Any = None) -> None:
        await asyncio.to_thread(self._engine.continue_generation)

    # ---- weights -------------------------------------------------------------------------------
    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        """serialized_named_tensors: one payload per TP rank; rank 0's holds every tensor (tandem's
        rank 0 loads and sends on)."""
        self._abort_all_first(obj)
        payloads = obj.serialized_named_tensors
        if isinstance(payloads, (list, tuple)):
            if not payloads:
                raise ValueError("serialized_named_tensors is empty: give one serialized payload per TP rank")
            payloads = payloads[0]
        return await asyncio.to_thread(self._engine.update_weights_from_serialized, payloads,
                                       getattr(obj, "load_format", None), getattr(obj, "flush_cache", True),
                                       _version(obj))

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        """names/dtypes/shapes, or older SGLang's single name/dtype/shape."""
        self._abort_all_first(obj)
        names = getattr(obj, "names", None)
        if names is None:
            names, dtypes, shapes = [obj.name], [obj.dtype], [obj.shape]
        else:
            dtypes, shapes = obj.dtypes, obj.shapes
        return await asyncio.to_thread(self._engine.update_weights_from_distributed, names, dtypes, shapes,
                                       getattr(obj, "group_name", "weight_update_group"),
                                       getattr(obj, "flush_cache", True), getattr(obj, "load_format", None),
                                       _version(obj))

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await asyncio.to_thread(self._engine.init_weights_update_group, obj.master_address, obj.master_port,
                                       obj.rank_offset, obj.world_size, getattr(obj, "group_name",
                                                                                "weight_update_group"),
                                       getattr(obj, "backend", "nccl"))

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await asyncio.to_thread(self._engine.destroy_weights_update_group,
                                       getattr(obj, "group_name", "weight_update_group"))

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        self._abort_all_first(obj)
        return await asyncio.to_thread(self._engine.update_weights_from_disk, obj.model_path,
                                       getattr(obj, "load_format", None), _version(obj),
                                       getattr(obj, "flush_cache", True))  # (ok, message, num_paused_requests)

    def _abort_all_first(self, obj: Any) -> None:
        """SGLang's abort_all_requests: what runs ends first (queued ahead of the update), as the
        HTTP routes do; otherwise the update waits for the requests sent before it to end."""
        if getattr(obj, "abort_all_requests", False):
            self._engine.abort_request(abort_all=True)

    # ---- colocated memory ----------------------------------------------------------------------
    async def release_memory_occupation(self, obj: Any = None, request: Any = None) -> None:
        _raise_if_refused(await asyncio.to_thread(self._engine.release_memory_occupation, _tags(obj)))

    async def resume_memory_occupation(self, obj: Any = None, request: Any = None) -> None:
        _raise_if_refused(await asyncio.to_thread(self._engine.resume_memory_occupation, _tags(obj)))

    async def freeze_gc(self) -> None:
        await asyncio.to_thread(self._engine.freeze_gc)

    async def get_internal_state(self) -> list[dict]:
        return (await asyncio.to_thread(self._engine.get_server_info))["internal_states"]


class _BaseMethods:
    def __init__(self, engine: Any, base: type) -> None:
        self._target, self._base = engine, base

    def __getattr__(self, name: str) -> Any:
        member = getattr(self._base, name, None)  # None: an instance attribute (server_args)
        return member.__get__(self._target) if callable(member) else getattr(self._target, name)


def _version(obj: Any) -> Optional[str]:
    return getattr(obj, "weight_version", None)


def _tags(obj: Any) -> Optional[list[str]]:
    return getattr(obj, "tags", None) or None  # SGLang: None or [] means all


def _raise_if_refused(reply: tuple[bool, str]) -> None:
    """SGLang's replies nothing on success and raises on failure (the route's 400)."""
    ok, message = reply
    if not ok:
        raise RuntimeError(message)
