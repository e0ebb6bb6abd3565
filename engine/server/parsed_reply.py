"""A chat reply's text as the OpenAI routes return it under --reasoning-parser and
--tool-call-parser: its thinking as reasoning_content, its calls as tool_calls, the rest as the
content (engine/server/reasoning_parser.py, tool_call_parser.py), whole or streamed."""

from __future__ import annotations

from typing import Any, Optional

from engine.server.reasoning_parser import StreamedReasoning, split_reply, thinks_first
from engine.server.tool_call_parser import StreamedCalls, fill_message, parsed_tool_names


class ReplyParsers:
    """The parsers a chat request's reply goes through (none: the text is the content)."""

    def __init__(self, reasoning_parser: Optional[str], tool_call_parser: Optional[str], req: Any) -> None:
        separate = getattr(req, "separate_reasoning", True) and not req._forced_calls
        self.reasoning = reasoning_parser if separate else None
        self.thinking_first = bool(self.reasoning) and thinks_first(self.reasoning, req)
        self.tool_names = parsed_tool_names(tool_call_parser, req)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.tool_names)

    def fill(self, message: dict, text: str, finish_reason: Optional[str]) -> Optional[str]:
        """message's reasoning_content, content and tool_calls from the whole reply -> finish_reason."""
        if self.reasoning:
            split = split_reply(text, self.thinking_first)
            message.update(reasoning_content=split.reasoning, content=split.content)
            text = split.content
        if self.tool_names:
            finish_reason = fill_message(message, text, finish_reason, self.tool_names)
        return finish_reason

    def stream(self) -> "ParsedStream":
        return ParsedStream(self)


class ParsedStream:
    """Per choice of a streamed reply: what each chunk adds, parsed."""

    def __init__(self, parsers: ReplyParsers) -> None:
        self.thinking = StreamedReasoning(parsers.thinking_first) if parsers.reasoning else None
        self.calls = StreamedCalls(parsers.tool_names) if parsers.tool_names else None
        self.content_sent: dict[int, int] = {}

    def delta(self, index: int, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], dict, Optional[str]]:
        """The choice's text so far -> (new content, other delta fields, finish_reason to send)."""
        extra: dict = {}
        body: Optional[str] = text
        if self.thinking is not None:
            reasoning, body = self.thinking.delta(index, text, finish_reason is not None)
            if reasoning:
                extra["reasoning_content"] = reasoning
        if self.calls is not None:
            content, calls, finish_reason = self.calls.delta(index, body or "", finish_reason)
            extra.update(calls)
        else:
            body = body or ""
            content = body[self.content_sent.get(index, 0):]
            self.content_sent[index] = len(body)
        # a thinking delta carries no content (null, as SGLang's)
        return (content or None) if "reasoning_content" in extra else content, extra, finish_reason
