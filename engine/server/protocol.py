"""Request bodies of the HTTP routes (pydantic), with SGLang's and OpenAI's field names.

Unknown fields are accepted and ignored, as SGLang does (clients send fields of newer or forked
versions: Miles' `return_routed_experts`, `selector`, ...); `UnknownFields` logs each name once.
Sampling fields are checked by SamplingParams, not here, so the error messages are the same as
for the in-process API.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger("tandem")


class _Lenient(BaseModel):
    """Unknown fields are kept aside (model_extra) so they can be logged, then ignored."""

    model_config = ConfigDict(extra="allow")


class UnknownFields:
    """Logs each ignored field name once (per server), at debug level."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def note(self, route: str, req: BaseModel) -> None:
        for name in (req.model_extra or {}):
            if name not in self.seen:
                self.seen.add(name)
                logger.debug("%s: ignoring unknown field %r (not used by tandem)", route, name)


class GenerateRequest(_Lenient):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: bool = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    token_ids_logprob: Any = None  # list of ids or one list per prompt: checked by the RequestBuilder
    logprob_distribution: Optional[str] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None

    def engine_kwargs(self) -> dict[str, Any]:
        return {"prompt": self.text, "input_ids": self.input_ids, "sampling_params": _nulls_dropped(self.sampling_params),
                "return_logprob": self.return_logprob,
                "logprob_start_len": -1 if self.logprob_start_len is None else self.logprob_start_len,
                "top_logprobs_num": self.top_logprobs_num or 0, "token_ids_logprob": self.token_ids_logprob,
                "logprob_distribution": self.logprob_distribution, "rid": self.rid}


def _nulls_dropped(params: Any) -> Any:
    """SGLang 0.5.23: an explicit null sampling field means its default (slime sends "stop": null)."""
    if isinstance(params, dict):
        return {k: v for k, v in params.items() if v is not None}
    if isinstance(params, list):
        return [_nulls_dropped(p) for p in params]
    return params


class AbortRequest(_Lenient):
    rid: Optional[Union[str, list[str]]] = ""  # SGLang's BaseReq rid: null means none, a list aborts each
    abort_all: bool = False

    def rids(self) -> list[str]:
        rids = self.rid if isinstance(self.rid, list) else [self.rid]
        return [r for r in rids if r]


class PauseGenerationRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


WEIGHT_SELECTORS = ("target", "draft", "all")


class BeginWeightUpdateRequest(_Lenient):
    """SGLang 0.5.23's /begin_weight_update (Miles opens one around every sync)."""
    selector: str = "all"

    @field_validator("selector")
    @classmethod
    def _known(cls, selector: str) -> str:
        if selector not in WEIGHT_SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(WEIGHT_SELECTORS)}; got {selector!r}")
        return selector


class UpdateWeightsFromDiskRequest(_Lenient):
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateWeightsFromTensorRequest(_Lenient):
    serialized_named_tensors: list[str]  # one per tensor-parallel rank (base64); one rank here
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class InitWeightsUpdateGroupRequest(_Lenient):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = Field(30.0, gt=0, le=600)  # the rendezvous' bound (tandem's; SGLang has none)


class DestroyWeightsUpdateGroupRequest(_Lenient):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedRequest(_Lenient):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


class UpdateWeightVersionRequest(_Lenient):
    new_version: str
    abort_all_requests: bool = True


class MemoryOccupationRequest(_Lenient):
    """/release_memory_occupation and /resume_memory_occupation (SGLang's body; none or [] = all tags)."""
    tags: Optional[list[str]] = None


class GetWeightsByNameRequest(_Lenient):
    name: str
    truncate_size: int = 100


class StartProfileRequest(_Lenient):
    output_dir: Optional[str] = None
    num_steps: Optional[int] = None
    activities: Optional[list[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None  # {"name": ..., "schema": {...}, "strict": ...}

    def grammar(self) -> dict:
        """The sampling_params grammar field this format asks for (SGLang's mapping)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
            return {"json_schema": json.dumps(schema)}
        return {}


OPENAI_GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # SGLang's grammar fields on its OpenAI routes


class _OpenAISampling(_Lenient):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    response_format: Optional[ResponseFormat] = None
    # SGLang's extra sampling fields on its OpenAI routes (sent through the openai package's extra_body)
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def carries_grammar(self) -> bool:
        """A grammar to compile: response_format json_object/json_schema, or SGLang's fields."""
        formatted = self.response_format is not None and self.response_format.type != "text"
        return formatted or any(getattr(self, kind) for kind in OPENAI_GRAMMAR_FIELDS)


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = 16
    logprobs: Optional[int] = None
    echo: bool = False


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: Any) -> Optional[str]:
        """OpenAI content parts [{"type": "text", "text": ...}] -> one string (text only)."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported; got type {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # SGLang's, e.g. {"enable_thinking": false}

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(set(kwargs or ()) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)")
        return kwargs


_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt", "return_dict",
                                       "return_tensors"})


def openai_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int) -> dict:
    params = {
        "max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "n": req.n, "stop": req.stop,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids, "min_new_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
    }
    params.update({name: getattr(req, name) for name in OPENAI_GRAMMAR_FIELDS if getattr(req, name)})
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.response_format is not None:
        params.update(req.response_format.grammar())
    return params
