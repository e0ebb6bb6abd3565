"""Request bodies of the HTTP routes (pydantic), with SGLang's and OpenAI's field names.

Unknown fields are accepted and ignored, as SGLang does (clients send fields of newer or forked
versions: Miles' `selector`, ...); `UnknownFields` logs each name once.
Sampling fields are checked by SamplingParams, not here, so the error messages are the same as
for the in-process API.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from engine.api.generate_request import GenerateRequest
from engine.api.sglang_kwargs import check_priority
from engine.api.weight_session import WEIGHT_SELECTORS
from engine.sampling_params import carries_grammar
from engine.server.refused_fields import REFUSED_GENERATE_FIELDS, refuse_given

logger = logging.getLogger("tandem")


class _Lenient(BaseModel):
    """Unknown fields are kept aside (model_extra) so they can be logged, then ignored."""

    model_config = ConfigDict(extra="allow")


class _NullsAsDefaults(_Lenient):
    """A top-level null means the field's default: SGLang's GenerateReqInput fields are Optional,
    OpenAI's spec marks its sampling fields nullable, and wrappers send unset fields as null."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_dropped(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class UnknownFields:
    """Logs each ignored field name once (per server), at debug level."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def note(self, route: str, req: BaseModel) -> None:
        for name in (req.model_extra or {}):
            if name not in self.seen:
                self.seen.add(name)
                logger.debug("%s: ignoring unknown field %r (not used by tandem)", route, name)


class GenerateBody(_NullsAsDefaults):
    """SGLang's /generate body: GenerateRequest's fields under SGLang's names (text for prompt)."""
    text: Optional[Union[str, list[str]]] = None
    # token ids are ints as sent: no true -> 1, "5" -> 5 or 6.0 -> 6 (pydantic's lax mode would)
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    # these three: one value, or one per prompt (SGLang's batch form)
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    token_ids_logprob: Any = None  # list of ids or one list per prompt: checked by the RequestBuilder
    logprob_distribution: Optional[str] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    return_routed_experts: Union[bool, list[bool]] = False
    routed_experts_start_len: Union[StrictInt, list[StrictInt], None] = 0
    lora_path: Any = None  # an adapter name, or one per prompt (None: the base): checked by the RequestBuilder
    return_prompt_token_ids: bool = False  # each output's "prompt_token_ids" (streamed chunks too)
    priority: Any = None  # an int, taken and ignored (SGLang's default: no priority scheduling)
    extra_key: Any = None  # a cache salt, or one per prompt: checked by the RequestBuilder
    # SGLang refuses these unless started for them (--enable-return-hidden-states,
    # --enable-custom-logit-processor); tandem has neither, so it refuses them too, not silently
    return_hidden_states: Union[bool, list[bool]] = False
    custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None

    @model_validator(mode="after")
    def _no_unsupported_outputs(self) -> "GenerateBody":
        refuse_unsupported(self.return_hidden_states, self.custom_logit_processor)
        check_priority(self.priority)
        refuse_given(self.model_extra or {}, REFUSED_GENERATE_FIELDS)  # SGLang's fields tandem cannot serve
        return self

    def carries_grammar(self) -> bool:
        return carries_grammar(self.sampling_params)

    def to_request(self) -> GenerateRequest:
        return GenerateRequest(
            prompt=self.text, input_ids=self.input_ids, sampling_params=_nulls_dropped(self.sampling_params),
            return_logprob=self.return_logprob, logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num or 0, token_ids_logprob=self.token_ids_logprob,
            logprob_distribution=self.logprob_distribution, rid=self.rid, stream=self.stream,
            return_routed_experts=self.return_routed_experts, lora_path=self.lora_path,
            routed_experts_start_len=self.routed_experts_start_len or 0,
            return_prompt_token_ids=self.return_prompt_token_ids, extra_key=self.extra_key)


def refuse_unsupported(hidden_states: Any, logit_processor: Any) -> None:
    """SGLang's checks for servers started without --enable-return-hidden-states and
    --enable-custom-logit-processor (each field: one value or one per prompt; truthy = asked for)."""
    if any(hidden_states) if isinstance(hidden_states, list) else hidden_states:
        raise ValueError("return_hidden_states is not supported: tandem does not return hidden states "
                         "(SGLang needs --enable-return-hidden-states for it); leave it false")
    if any(logit_processor) if isinstance(logit_processor, list) else logit_processor:  # SGLang's: "" passes
        raise ValueError("custom_logit_processor is not supported: tandem runs no client-supplied code "
                         "(SGLang needs --enable-custom-logit-processor for it); use logit_bias, or leave it null")


def _nulls_dropped(params: Any) -> Any:
    """SGLang 0.5.23: an explicit null sampling field means its default (slime sends "stop": null);
    but a null max_new_tokens is no limit of its own (up to the context length), where a missing
    one is the default 128, as SGLang's scheduler reads them."""
    if isinstance(params, dict):
        return {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}
    if isinstance(params, list):
        return [_nulls_dropped(p) for p in params]
    return params


class AbortRequest(_Lenient):
    rid: Optional[Union[str, list[str]]] = ""  # SGLang's BaseReq rid: null means none, a list aborts each
    abort_all: bool = False
    prefix: bool = False  # Miles: every request whose rid starts with rid (an adapter's "name::")

    def rids(self) -> list[str]:
        rids = self.rid if isinstance(self.rid, list) else [self.rid]
        return [r for r in rids if r]


class PauseGenerationRequest(_Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"




class PostProcessWeightsRequest(_NullsAsDefaults):
    """slime's and Miles' SGLang patch: restore quantized weights before a load, re-pack after one."""
    restore_weights_before_load: bool = False
    post_process_quantization: bool = False


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


class PullWeightsRequest(_Lenient):
    """slime's /pull_weights (its SGLang patch): bring local_checkpoint_dir to target_version."""
    local_checkpoint_dir: str
    source_dir: str
    target_version: StrictInt


class UpdateWeightsFromTensorRequest(_Lenient):
    serialized_named_tensors: list[str]  # one per tensor-parallel rank (base64); one rank here
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class InitWeightsUpdateGroupRequest(_Lenient):
    master_address: str
    master_port: int
    rank_offset: int = Field(ge=0, lt=1 << 31)  # NCCL's ranks are C ints
    world_size: int = Field(ge=1, lt=1 << 31)
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = Field(30.0, gt=0, le=600)  # the rendezvous' bound (tandem's; SGLang has none)


class WeightsCheckerRequest(_Lenient):
    action: str = "checksum"
    skip_tensor_list: Optional[list[str]] = None
    allow_quant_error: bool = False


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
    start_step: Optional[StrictInt] = Field(None, ge=0)  # SGLang's: begin after this many more forward passes
    num_steps: Optional[StrictInt] = Field(None, ge=1)  # stop after this many
    profile_by_stage: bool = False
    activities: Optional[list[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None


class DetokenizeRequest(_Lenient):
    model: Optional[str] = None
    tokens: Union[list[StrictInt], list[list[StrictInt]]]
    skip_special_tokens: bool = True
