"""--tool-call-parser qwen25 (SGLang's name; "qwen" and "hermes" are the same format): a chat reply's
tool calls, as Qwen2.5 / Qwen3 and Hermes templates have the model write them, come back as the
message's tool_calls with tool_choice "auto".

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A block
whose JSON names one of the request's tools becomes a call (its arguments as a JSON string, as
OpenAI's); anything else (text around the blocks, a block cut by max_tokens, bad JSON, an unknown
name, which SGLang's parser drops with a warning) stays the content. A streamed reply sends its
text up to the first `<tool_call>` as it comes and the calls in its last delta.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from engine.server.forced_tool_calls import openai_tool_call
from engine.server.reasoning_parser import tag_start_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ParsedReply:
    content: Optional[str]  # the text outside the calls, stripped; None when there is none
    calls: list[dict]  # OpenAI's tool_calls entries


def parsed_tool_names(parser: Optional[str], req: Any) -> Optional[set[str]]:
    """The tools whose calls a chat reply's text may hold: with a parser, tools and tool_choice
    auto (unset is auto); None where the text is the content (or forced calls are parsed instead)."""
    if not parser or not req.tools or req._forced_calls or req.tool_choice not in (None, "auto"):
        return None
    return {tool.function.name for tool in req.tools}


def parse_reply(text: str, tool_names: set[str]) -> ParsedReply:
    calls: list[dict] = []
    kept: list[str] = []
    end = 0
    for start, stop in _blocks(text):
        call = _call(text[start + len(OPEN):stop - len(CLOSE)], tool_names, len(calls))
        kept.append(text[end:start] if call is not None else text[end:stop])
        end = stop
        if call is not None:
            calls.append(call)
    kept.append(text[end:])
    content = "".join(kept).strip()
    return ParsedReply(content or None, calls)


def _blocks(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each <tool_call>...</tool_call> block, by str.find: linear in the text (a
    regex with a lazy group between whitespace runs took cubic time on a reply of spaces, holding the GIL)."""
    start = text.find(OPEN)
    while start >= 0:
        close = text.find(CLOSE, start + len(OPEN))
        if close < 0:
            return
        yield start, close + len(CLOSE)
        start = text.find(OPEN, close + len(CLOSE))


def streamable_len(text: str) -> int:
    """How much of a reply's text may be sent as content now: up to its first `<tool_call>`, less
    a tail that may be the start of one."""
    start = text.find(OPEN)
    return start if start >= 0 else len(text) - tag_start_len(text, OPEN)


def fill_message(message: dict, text: str, finish_reason: Optional[str], tool_names: set[str]) -> Optional[str]:
    """message's content and tool_calls from the reply's text -> the choice's finish_reason:
    "tool_calls" for a reply with calls that stopped (as SGLang), else as it was."""
    parsed = parse_reply(text, tool_names)
    if not parsed.calls:
        return finish_reason
    message.update(content=parsed.content, tool_calls=parsed.calls)
    return _with_calls(finish_reason)


class StreamedCalls:
    """A streamed reply's deltas, per choice: its content up to a call as it comes, the calls held
    back until the reply ends."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self.shown: dict[int, int] = {}  # per choice: characters of its text sent as content

    def delta(self, index: int, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], dict, Optional[str]]:
        """The choice's text so far -> (content to send now, other delta fields, finish_reason)."""
        shown = self.shown.get(index, 0)
        if finish_reason is None:
            upto = max(streamable_len(text), shown)
            self.shown[index] = upto
            return text[shown:upto], {}, None
        parsed = parse_reply(text[shown:], self.tool_names)
        if not parsed.calls:
            return text[shown:], {}, finish_reason
        return parsed.content, {"tool_calls": parsed.calls}, _with_calls(finish_reason)


def _with_calls(finish_reason: Optional[str]) -> Optional[str]:
    """A reply with calls that stopped finishes as "tool_calls" (SGLang's); one cut keeps its reason."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _call(body: str, tool_names: set[str], index: int) -> Optional[dict]:
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in tool_names:
        return None
    return openai_tool_call(index, call["name"], call.get("arguments", call.get("parameters", {})))
