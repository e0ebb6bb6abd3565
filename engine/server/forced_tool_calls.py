"""tool_choice "required" or a named function, served as SGLang serves them (without a tool-call
parser): the reply is constrained to a JSON array of {"name", "parameters"} objects, one per call
(SGLang's function_call get_json_schema_constraint), and that array comes back as the message's
tool_calls, each with its arguments as a JSON string and finish_reason "tool_calls".
"""

from __future__ import annotations

import json
from typing import Any, Optional

from engine.api.request_ids import fresh_rid
from engine.sampling_params import GRAMMAR_FIELDS
from engine.server.chat_messages import chosen_tool_name


def forced_call_schema(tools: Optional[list], tool_choice: Any, parallel_tool_calls: bool = True) -> Optional[dict]:
    """The JSON schema the reply must follow, or None where the model chooses (auto, none, unset).
    tools: the request's ChatTool list (a named choice is checked against it before this)."""
    if tool_choice == "required":
        if not tools:
            raise ValueError('tool_choice "required" needs tools: send the functions the model must call')
        chosen = list(tools)
        items: dict = {"type": "object", "anyOf": [_call_schema(t.function) for t in chosen]}
    elif isinstance(tool_choice, dict):
        name = chosen_tool_name(tool_choice)
        chosen = [t for t in tools or () if t.function.name == name]
        if not chosen:
            raise ValueError(f"tool_choice names tool {name!r}, which is not in tools")
        items = _call_schema(chosen[0].function)
    else:
        return None
    schema = {"type": "array", "minItems": 1, "items": items}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    defs = _shared_defs(chosen)
    if defs:  # a parameters schema's "#/$defs/..." references resolve against the root
        schema["$defs"] = defs
    return schema


def _shared_defs(tools: list) -> dict:
    """Every tool's parameters' $defs, at the root as SGLang hoists them; one name, one schema."""
    defs: dict = {}
    for tool in tools:
        for name, schema in ((tool.function.parameters or {}).get("$defs") or {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs {name!r} twice, differently: give them distinct names")
    return defs


def _call_schema(function: Any) -> dict:
    parameters = function.parameters or {"type": "object", "properties": {}}
    return {"properties": {"name": {"type": "string", "enum": [function.name]}, "parameters": parameters},
            "required": ["name", "parameters"]}


def constrain(params: dict, schema: Optional[dict]) -> bool:
    """Put the schema into the sampling params; False (and params untouched) where there is none or
    the request brings its own grammar (SGLang: the request's constraint wins over the tool calls')."""
    if schema is None or any(params.get(name) for name in GRAMMAR_FIELDS):
        return False
    params["json_schema"] = json.dumps(schema)
    return True


def parse_calls(text: str) -> Optional[list[dict]]:
    """The reply's calls in OpenAI's shape, or None where the text is not a complete array of
    calls (a reply cut by max_tokens: it then stays the message's content)."""
    try:
        calls = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [openai_tool_call(i, c["name"], c.get("parameters", {})) for i, c in enumerate(calls)]


def openai_tool_call(index: int, name: str, arguments: Any) -> dict:
    """One tool_calls entry in OpenAI's shape: its arguments as a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{fresh_rid()[:24]}", "index": index, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def as_tool_calls(message: dict, text: str, finish_reason: Optional[str]) -> Optional[str]:
    """Fill message's tool_calls (content null) from a forced reply's text, which stays the content
    where it is no array of calls; -> the choice's finish_reason: "tool_calls" for a reply that
    stopped (SGLang renames it before parsing), else as it was (a reply cut by max_tokens)."""
    calls = parse_calls(text)
    if calls is None:
        message["content"] = text
    else:
        message.update(content=None, tool_calls=calls)
    return "tool_calls" if finish_reason == "stop" else finish_reason
