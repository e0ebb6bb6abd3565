"""Chat messages and tools as the chat template sees them, the way SGLang hands them over:
every field the client sent (tool_calls, tool_call_id, name, reasoning_content, ...), null content
as "", tool-call arguments parsed from their JSON string into an object (HF templates expect one),
and `tools` passed to the template unless tool_choice is "none" (a named choice keeps that tool)."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import field_validator, model_validator

from engine.sampling_params import nests_deeper
from engine.server.protocol import _Lenient
from engine.server.template_content import ContentFormat, joined_text

MAX_TEMPLATE_NESTING = 64  # levels of objects/arrays handed to a template: tool schemas need ~10

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Lenient):
    role: Role
    content: Optional[Union[str, list[dict[str, Any]]]] = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, role: Any) -> Any:
        return role.lower() if isinstance(role, str) else role  # SGLang: roles are case-insensitive

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        """OpenAI content parts: text ones only, each as {"type": "text", "text": ...}."""
        if not isinstance(content, list):
            return content
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported; got type {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f'a text content part needs its text as a string: {{"type": "text", "text": "..."}}; '
                                 f"got {sorted(part)} with text {part.get('text')!r}")
        return [{"type": "text", "text": part["text"]} for part in content]

    @model_validator(mode="after")
    def _typed_extras(self) -> "ChatMessage":
        """The fields SGLang types besides role and content: a wrong type is the client's error,
        not something for the template to trip over (or render) later."""
        extra = self.model_extra or {}
        for name in ("tool_call_id", "name", "reasoning_content"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise ValueError(f"{name} must be a string; got {type(extra[name]).__name__}")
        calls = extra.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ValueError('tool_calls must be a list of objects ({"id": ..., "type": "function", '
                             '"function": {"name": ..., "arguments": "<JSON>"}})')
        for call in calls or []:
            if call.get("function") is not None and not isinstance(call["function"], dict):
                raise ValueError('a tool call\'s function must be an object ({"name": ..., "arguments": ...})')
        return self

    def template_dict(self, index: int, content_format: ContentFormat = "string") -> dict[str, Any]:
        """The message as the template gets it: parts joined into one string for a template of
        strings, as they came for one that loops over them (engine/server/template_content.py)."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        if self.role == "assistant" and isinstance(extra.get("tool_calls"), list):
            extra["tool_calls"] = [_parsed_arguments(call, index) for call in extra["tool_calls"]]
        content = self.content if content_format == "openai" else joined_text(self.content)
        return {"role": self.role, "content": content or "", **extra}


def template_messages(messages: list[ChatMessage], content_format: ContentFormat, continue_final: bool
                      ) -> tuple[list[dict[str, Any]], Optional[str]]:
    """The messages as the template gets them, and with continue_final_message the last assistant
    message's text, taken off the list: the start of the reply (None: not continuing one)."""
    dicts = [m.template_dict(i, content_format) for i, m in enumerate(messages)]
    if continue_final and dicts and dicts[-1]["role"] == "assistant":
        return dicts, joined_text(dicts.pop()["content"])
    return dicts, None


def _parsed_arguments(call: Any, index: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past the parser's limit
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"messages[{index}].tool_calls: function.arguments must be a JSON object (as a string)")
    return {**call, "function": {**function, "arguments": arguments}}


class ToolFunction(_Lenient):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ChatTool(_Lenient):
    type: str = "function"
    function: ToolFunction


def template_tools(tools: Optional[list[ChatTool]], tool_choice: Any) -> Optional[list[dict]]:
    """The tools the template renders, each as the client sent it; None for none."""
    if isinstance(tool_choice, dict) and not tools:  # OpenAI refuses it too: there is no tool to call
        raise ValueError("tool_choice names a function, but the request has no tools: send the tools too")
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = chosen_tool_name(tool_choice)
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise ValueError(f"tool_choice names tool {name!r}, which is not in tools")
        tools = chosen
    elif tool_choice not in (None, "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function; got {tool_choice!r}")
    return [t.model_dump(exclude_unset=True) for t in tools]


def chosen_tool_name(tool_choice: dict) -> str:
    """The function a named tool_choice picks; a ValueError saying the shape when it is another."""
    function = tool_choice.get("function")
    if (tool_choice.get("type", "function") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": "<a tool\'s name>"}}; '
                         f"got {json.dumps(tool_choice)[:200]}")
    return function["name"]


def check_nesting(value: Any, what: str, limit: int = MAX_TEMPLATE_NESTING) -> None:
    """A ValueError when objects and arrays in `value` nest deeper than `limit`: the template
    library walks them recursively (700 levels were a RecursionError, a 500)."""
    if nests_deeper(value, limit):
        raise ValueError(f"{what}: objects and arrays nest deeper than {limit} levels, more than a chat "
                         "template takes")
