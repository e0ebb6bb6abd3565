"""EngineAPI: what an engine offers its callers, wherever it runs.

`Engine` satisfies it in this process; engine_client's HttpClient (SGLang's routes, spelled by
hand) and RayClient (the Ray engine actor, every Engine method forwarded by name) satisfy it
remotely, so RL code (RolloutManager, weight pushes, colocation) takes any of them. Method names,
arguments and replies are SGLang's Engine's: generate takes GenerateRequest's fields and returns
SGLang's dicts; weight and memory verbs return (success, message), update_weights_from_disk
(success, message, num_paused_requests) as sglang.Engine's does. Engine has more public
methods (get_weights_by_name, check_weights, update_weight_version, ...): RayClient forwards
those too; this protocol lists what every form implements.
"""

from __future__ import annotations

from typing import Any, Awaitable, Optional, Protocol, Union, runtime_checkable

Reply = tuple[bool, str]  # (success, message): a refusal changes nothing and says why
DiskReply = tuple[bool, str, int]  # sglang.Engine.update_weights_from_disk's: Reply + num_paused_requests


@runtime_checkable
class EngineAPI(Protocol):
    # ---- generation: GenerateRequest's fields (engine/api/generate_request.py) -----------------
    def generate(self, *args: Any, **kwargs: Any) -> Union[dict, list[dict]]: ...

    def async_generate(self, *args: Any, **kwargs: Any) -> Awaitable[Union[dict, list[dict]]]: ...

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False, prefix: bool = False) -> None: ...

    async def async_abort_request(self, rid: Optional[str] = None, abort_all: bool = False,
                                  prefix: bool = False) -> None: ...

    def flush_cache(self) -> bool: ...

    # ---- pause and weights ---------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def update_weights_from_tensor(self, named_tensors: Any, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None) -> Reply: ...

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None, flush_cache: bool = True) -> DiskReply: ...

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 30.0) -> Reply: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        load_format: Optional[str] = None,
                                        weight_version: Optional[str] = None) -> Reply: ...

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Reply: ...

    def begin_weight_update(self, selector: str = "all") -> Reply:
        """SGLang 0.5.23's session around a sync; a second begin is refused until end_weight_update."""
        ...

    def end_weight_update(self) -> Reply: ...

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> Reply: ...

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> Reply: ...

    # ---- LoRA adapters: SGLang's replies {"success", "error_message", "loaded_adapters"} ---------
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict: ...

    def unload_lora_adapter(self, lora_name: str) -> dict: ...

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: Any = None, config_dict: Optional[dict] = None,
                                       load_format: Optional[str] = None, pinned: bool = False,
                                       serialized_tensors: Any = None, expected_checksums: Optional[dict] = None
                                       ) -> dict: ...

    # ---- state and lifetime --------------------------------------------------------------------
    def get_weight_version(self) -> str: ...

    def get_model_info(self) -> dict:
        """SGLang's /model_info keys: model_path (the checkpoint served now), weight_version, ..."""
        ...

    def get_server_info(self) -> dict: ...

    def get_load(self) -> list[dict]:
        """SGLang's /get_load: per data-parallel rank, num_reqs / num_waiting_reqs / num_tokens
        (ROLL waits on them)."""
        ...

    def health(self) -> bool:
        """True while the engine answers and its core is alive."""
        ...

    def close(self) -> None:
        """Let go of the engine: a client that owns it (and an in-process Engine) shuts it down."""
        ...


def answers_reply(method: Any) -> bool:
    """Whether a method answers (success, message, ...): its remote forms (the Ray actor, the HTTP
    routes) turn a ValueError from it into a refusal the caller reads (refusal())."""
    return _reply_kind(method) is not None


def refusal(method: Any, message: str) -> tuple:
    """A method's refusal in its own reply's shape: (False, message), or (False, message, 0) for a
    DiskReply (no request was paused)."""
    return (False, message, 0) if _reply_kind(method) is DiskReply else (False, message)


def _reply_kind(method: Any) -> Any:
    import inspect

    annotation = inspect.signature(method).return_annotation
    if annotation == Reply or annotation in ("Reply", "tuple[bool, str]", "Tuple[bool, str]"):
        return Reply
    if annotation == DiskReply or annotation in ("DiskReply", "tuple[bool, str, int]", "Tuple[bool, str, int]"):
        return DiskReply
    return None
