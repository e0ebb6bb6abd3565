"""Request bodies of the HTTP routes (pydantic), with SGLang's and OpenAI's field names.

Sampling fields are checked by SamplingParams, not here, so the error messages are the same as
for the in-process API.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Strict):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    logprob_distribution: Optional[str] = None
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskRequest(_Strict):
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateWeightsFromTensorRequest(_Strict):
    serialized_named_tensors: list[str]  # one per tensor-parallel rank (base64); one rank here
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class InitWeightsUpdateGroupRequest(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


class UpdateWeightVersionRequest(_Strict):
    new_version: str
    abort_all_requests: bool = True


class _OpenAISampling(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use

    model: Optional[str] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = 16
    logprobs: Optional[int] = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0


def openai_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int) -> dict:
    params = {
        "max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "n": req.n, "stop": req.stop,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
    }
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    return params
