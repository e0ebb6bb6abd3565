"""Every message that crosses into or out of the engine core, in one module.

The front end (engine.api.Engine) talks to an EngineCore only with these: small dataclasses that
pickle, so the core can run on a thread or in its own process unchanged. Requests go in through
`EngineCore.handle`; `step` hands back ReqOutputs; control messages answer with a Reply (a value
plus the outputs the message finished). Nothing outside the core reads core attributes: stats,
info and the weight version come back as messages too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from engine.finish_reasons import abort_reason
from engine.scheduler.request import RequestOptions

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    return mode


def check_memory_tags(tags: Optional[list[str]]) -> list[str]:
    """None means every tag; an unknown tag is a ValueError naming the known ones."""
    if tags is None:
        return list(MEMORY_TAGS)
    tags = [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tag {bad[0]!r}; tags are {', '.join(MEMORY_TAGS)}")
    return tags


# ---- generation ------------------------------------------------------------------------------
@dataclass
class ReqInput(RequestOptions):
    """One sample of a GenerateRequest, tokenized and validated by the front end's RequestBuilder:
    its prompt's ids and its options (rid, sampling params, seed, logprob options, stream; the
    scheduler's Req carries the same RequestOptions)."""
    input_ids: list[int] = field(kw_only=True)
    return_prompt_token_ids: bool = field(default=False, kw_only=True)  # the front end adds them to its outputs

    @property
    def core_detokenizes(self) -> bool:
        """The core builds text only when it must see it while generating (stop strings); the
        front end decodes every other request's ids (engine/api/text_builder.py)."""
        return self.sampling_params.watches_text


@dataclass
class AbortReq:
    rid: Optional[str] = None  # None: abort everything
    message: str = "aborted by request"
    prefix: bool = False  # every request whose rid starts with rid (Miles aborts a LoRA adapter's "name::")


@dataclass
class ReqOutput:
    rid: str
    finished: bool
    output: dict[str, Any]  # SGLang's {"text", "output_ids", "meta_info"}, cumulative so far
    # a streamed request's output-side logprob lists start at this output position (each position
    # is sent once; its prompt-side ones only with position 0): engine/api/streamed_logprobs.py
    # joins them back into SGLang's cumulative lists
    logprobs_from: int = 0

    @classmethod
    def error(cls, rid: str, message: str, status_code: Optional[int] = None) -> "ReqOutput":
        """A final answer for a request that ends with an error and no output. status_code (as
        SGLang's abort reasons carry it): the HTTP status a non-streamed request answers with."""
        reason = abort_reason(message, status_code)
        return cls(rid, True, {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": reason}})


# ---- control ---------------------------------------------------------------------------------
@dataclass
class FlushCacheReq:
    pass


@dataclass
class PauseReq:
    mode: str = "abort"


@dataclass
class ContinueReq:
    pass


@dataclass
class UpdateWeightsReq:
    """One source (a weight_sync.base.WeightSource: tensors, a checkpoint, a broadcast group)."""
    source: Any
    flush_cache: bool = True
    weight_version: Optional[str] = None


@dataclass
class InitWeightsGroupReq:
    """Starts the rendezvous off the core loop and answers None (forming) or a refusal at once;
    WeightsGroupStatusReq then says when it formed or failed (within timeout_s)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 30.0


@dataclass
class WeightsGroupStatusReq:
    """None while the group's rendezvous runs, then (success, message) once."""
    group_name: str = "weight_update_group"


@dataclass
class DestroyWeightsGroupReq:
    group_name: str = "weight_update_group"


@dataclass
class SetWeightVersionReq:
    new_version: str


@dataclass
class GetWeightVersionReq:
    pass


@dataclass
class ReleaseMemoryReq:
    tags: Optional[list[str]] = None  # None: weights, kv_cache and cuda_graph


@dataclass
class ResumeMemoryReq:
    tags: Optional[list[str]] = None


@dataclass
class StatsReq:
    pass


@dataclass
class GetWeightsByNameReq:
    """The first `truncate_size` rows of a parameter, by its HF name (a nested float list)."""
    name: str
    truncate_size: int = 100


@dataclass
class WeightsChecksumReq:
    """sha256 over every parameter (engine/core/weight_queries.py says how)."""


@dataclass
class WeightsCheckerReq:
    """SGLang's /weights_checker: snapshot | reset_tensors | compare | checksum (engine/core/weight_checker.py)."""
    action: str
    skip_tensor_list: tuple[str, ...] = ()
    allow_quant_error: bool = False


@dataclass
class FreezeGCReq:
    """SGLang's freeze_gc: the core process freezes its garbage collector (engine/gc_freeze.py)."""


@dataclass
class CheckIntegrityReq:
    """Asserts free + cached + in use == pool size; the AssertionError comes back to the caller."""


@dataclass
class LoadLoraReq:
    """A PEFT adapter from a directory (lora_path), or from tensors: config_dict (its
    adapter_config) and `source`, an engine.lora.tensor_payload LoRATensors (in memory) or
    SerializedLoRATensors (opened off the step through the weight payloads' allowlist, as an
    update's serialized source)."""
    lora_name: str
    lora_path: Optional[str] = None
    config_dict: Optional[dict] = None
    source: Any = None
    pinned: bool = False
    expected_checksums: Optional[dict] = None  # name -> sha256 hex of the tensor's bytes (Miles' check)


@dataclass
class UnloadLoraReq:
    """Answers None while requests still use the adapter (it takes no new ones meanwhile): ask
    again; cancel=True gives up waiting and the adapter serves again."""
    lora_name: str
    cancel: bool = False


@dataclass
class Reply:
    """A control message's return value, plus the outputs it produced (tokens of the drained
    batch, requests it aborted) for the front end to deliver."""
    value: Any
    outputs: list = field(default_factory=list)


# ---- what the core reports -------------------------------------------------------------------
@dataclass(frozen=True)
class CoreInfo:
    """Fixed at start-up: what the front end needs to build requests and answer info routes."""
    model_path: str
    tokenizer_path: str
    vocab_size: int
    context_len: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    attention_backend: str
    max_total_num_tokens: int
    chunked_prefill_size: Optional[int]
    max_running_requests: int
    available_gb: float
    lora_adapters: tuple[tuple[str, Optional[str]], ...] = ()  # (name, path) loaded at start (--lora-paths)


@dataclass(frozen=True)
class StatsSnapshot:
    """Counters and gauges at one moment, for /metrics, /get_server_info, /v1/loads and bench."""
    num_steps: int
    num_prefill_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_lookahead_steps: int
    num_mixed_steps: int
    num_retractions: int
    num_running_reqs: int
    num_waiting_reqs: int
    new_token_ratio: float
    kv_tokens_used: int
    kv_tokens_total: int
    num_weight_updates: int
    weight_update_seconds: float
    paused: bool
    memory_released: tuple[str, ...]
    weight_version: str
    uptime_s: float
