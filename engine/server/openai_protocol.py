"""Request bodies of the OpenAI-compatible routes (pydantic), as the openai package and SGLang's
OpenAI layer send them. Top-level nulls mean the default (OpenAI marks these fields nullable);
unknown fields are ignored. Sampling values are checked by SamplingParams, so the messages match
/generate's."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field, PrivateAttr, StrictInt, field_validator, model_validator

from engine.server.chat_messages import ChatMessage, ChatTool, template_tools
from engine.server.protocol import _Lenient, _NullsAsDefaults, refuse_unsupported
from engine.server.refused_fields import REFUSED_OPENAI_FIELDS, refuse_given


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # SGLang's: usage on every chunk (include_usage or not)


class ResponseFormat(_Lenient):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema; or SGLang's
    structural_tag (its structures and triggers, or xgrammar's format, as extra fields)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[dict[str, Any]] = None  # {"name": ..., "schema": {...}, "strict": ...}

    @model_validator(mode="before")
    @classmethod
    def _bare_schema(cls, values: Any) -> Any:
        """SGLang's shortcut: {"type": "json_schema", "schema": {...}} is the wrapped form, named
        after the schema's title."""
        if not isinstance(values, dict) or values.get("type") != "json_schema" or values.get("json_schema"):
            return values
        schema = values.get("schema")
        if not isinstance(schema, dict):
            return values
        rest = {k: v for k, v in values.items() if k != "schema"}
        return {**rest, "json_schema": {"name": schema.get("title", "Schema"), "schema": schema, "strict": False}}

    def grammar(self) -> dict:
        """The sampling_params grammar field this format asks for (SGLang's mapping)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "structural_tag":  # the whole format is the tag, as SGLang passes it
            return {"structural_tag": json.dumps(self.model_dump(exclude={"json_schema"}))}
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}} '
                                 '(or SGLang\'s {"schema": {...}})')
            return {"json_schema": json.dumps(schema)}
        return {}


OPENAI_GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # SGLang's grammar fields on its OpenAI routes


class _OpenAISampling(_NullsAsDefaults):
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
    logit_bias: Optional[dict[str, Any]] = None  # {"token id": bias}: checked by SamplingParams
    # SGLang's extra sampling fields on its OpenAI routes (sent through the openai package's extra_body)
    stop_token_ids: Optional[list[StrictInt]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    rid: Optional[Union[str, list[str]]] = None  # SGLang's: the id /abort_request takes (one per prompt)
    return_hidden_states: Union[bool, Literal["last"]] = False  # refused unless false, as SGLang without them
    custom_logit_processor: Optional[str] = None
    lora_path: Any = None  # SGLang's: the adapter for the request (or one per prompt)
    return_routed_experts: bool = False  # SGLang's: first choice's routes as sglext.routed_experts
    routed_experts_start_len: Optional[StrictInt] = None  # SGLang's: the routes from this position on
    custom_params: Any = None  # SGLang's: passed on in the sampling params (which check it)
    cache_salt: Optional[str] = None  # vLLM's and SGLang's: the prompt's radix-cache namespace
    extra_key: Optional[str] = None  # SGLang's: appended to cache_salt

    def cache_key(self) -> Optional[str]:
        """SGLang's extra_key for these routes: cache_salt then extra_key, joined; None for neither."""
        return "".join(part for part in (self.cache_salt, self.extra_key) if part) or None

    def adapter(self, lora_enabled: bool) -> Any:
        """The LoRA adapter SGLang's OpenAI routes select: an explicit lora_path first, else the
        `model` field's "base:adapter" form. Without LoRA a model name is only a name (some have
        colons), while an explicit lora_path is still refused by the RequestBuilder."""
        if self.lora_path is not None or not lora_enabled or not self.model or ":" not in self.model:
            return self.lora_path
        adapter = self.model.split(":", 1)[1]
        if not adapter:
            raise ValueError(f"model {self.model!r} names no adapter after ':' (use base:adapter)")
        return adapter

    @model_validator(mode="after")
    def _no_unsupported_outputs(self) -> "_OpenAISampling":
        refuse_unsupported(self.return_hidden_states, self.custom_logit_processor)
        refuse_given(self.model_extra or {}, REFUSED_OPENAI_FIELDS)
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def carries_grammar(self) -> bool:
        """A grammar to compile: response_format json_object/json_schema, or SGLang's fields."""
        formatted = self.response_format is not None and self.response_format.type != "text"
        return formatted or any(getattr(self, kind) for kind in OPENAI_GRAMMAR_FIELDS)


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]  # ids as sent (no true -> 1)
    max_tokens: int = Field(16, ge=0)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    return_token_ids: bool = False  # SGLang's: each choice's token_ids and prompt_token_ids (streamed too)
    # OpenAI's: text after the completion (fill-in-the-middle) and server-side best-of-k; SGLang
    # ignores both, but the reply would not be what was asked, so each is refused when it matters
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    _prompt_ids: list[list[int]] = PrivateAttr(default_factory=list)  # per prompt, when return_token_ids

    @model_validator(mode="after")
    def _no_unserved_options(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported: tandem does no fill-in-the-middle; put the text in prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: tandem returns every sample; "
                             f"leave best_of null (or equal to n) and pick among n samples yourself")
        return self


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: bool = True  # False: a forced tool_choice makes exactly one call
    continue_final_message: bool = False  # SGLang: the last assistant message is a prefix to continue
    separate_reasoning: bool = True  # SGLang's: false keeps the thinking in the content under --reasoning-parser
    reasoning_effort: Optional[str] = None  # handed to the chat template (gpt-oss templates read it)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # SGLang's, e.g. {"enable_thinking": false}
    chat_template: Optional[str] = None  # vLLM's: the client's own template (--trust-request-chat-template)
    # SGLang's: the prompt's token ids as the client rendered them (the chat template is skipped;
    # Miles' sessions send them), and what else each choice carries: the engine's meta_info,
    # the prompt's ids, the output's ids (with the prompt's)
    input_ids: Optional[list[StrictInt]] = None
    return_meta_info: bool = False
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    _prompt_ids: list[int] = PrivateAttr(default_factory=list)  # the rendered (or given) prompt
    _forced_calls: bool = PrivateAttr(default=False)  # the reply is constrained to tool calls (forced_tool_calls.py)

    @model_validator(mode="after")
    def _token_outputs_not_streamed(self) -> "ChatCompletionRequest":
        for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
            if self.stream and getattr(self, name):
                raise ValueError(f"{name} is not supported with streaming; set stream=false to use {name}=true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(set(kwargs or ()) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)")
        return kwargs

    def template_tools(self) -> Optional[list[dict]]:
        return template_tools(self.tools, self.tool_choice)

    def template_kwargs(self) -> dict[str, Any]:
        """reasoning_effort, then chat_template_kwargs (which win), as SGLang passes them; the
        request's own chat_template last (it is refused unless the server trusts it)."""
        extra = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        kwargs = {**extra, **(self.chat_template_kwargs or {})}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def brings_template(self) -> bool:
        """Whether the request carries a chat template of its own (either field)."""
        return self.chat_template is not None or "chat_template" in (self.chat_template_kwargs or {})


class TokenizeRequest(_Lenient):
    """SGLang's /tokenize body (entrypoints/openai/protocol.py): a prompt, or (its newer, vLLM's
    chat form) messages rendered by the chat template."""
    model: Optional[str] = None
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) or messages (a chat, rendered by the chat template)")
        return self


# the render's own arguments (the server sets them) and the template variables it fills itself
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                                       "return_tensors", "tools", "documents", "continue_final_message", "padding",
                                       "truncation", "max_length", "tokenizer_kwargs",
                                       "return_assistant_tokens_mask",
                                       # engine.tokenizer.apply_chat_template's own arguments
                                       "tokenizer", "check", "assistant_prefix"})


def openai_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int,
                           defaults: Optional[dict] = None) -> dict:
    """Engine sampling params; `defaults` (the model's) stand in for the fields the request left unset."""
    params = {
        "max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "n": req.n, "stop": req.stop,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids, "stop_regex": req.stop_regex, "min_new_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
    }
    params.update({name: value for name, value in (defaults or {}).items() if name not in req.model_fields_set})
    params.update({name: getattr(req, name) for name in OPENAI_GRAMMAR_FIELDS if getattr(req, name)})
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.custom_params is not None:
        params["custom_params"] = req.custom_params
    if req.logit_bias:  # {} is no bias (OpenAI's default)
        params["logit_bias"] = req.logit_bias
    if req.response_format is not None:
        params.update(req.response_format.grammar())
    return params
