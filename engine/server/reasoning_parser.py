"""--reasoning-parser (SGLang's names): a chat reply's thinking, `<think>...</think>`, comes back
as the message's reasoning_content and the rest as its content.

As SGLang's serving_chat: "qwen3-thinking" and "deepseek-r1" replies think until `</think>` (their
templates open it in the prompt); "qwen3" too unless the request's chat_template_kwargs set
enable_thinking to anything but true, and then a reply thinks only where it opens `<think>`. A
reply cut inside its thinking is all reasoning_content, as SGLang's detector gives it. A streamed
reply sends the thinking as reasoning_content deltas and the rest as content as they come,
holding back only a tail that may be the start of a tag. A request's `separate_reasoning: false`
keeps the whole text as the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

START, END = "<think>", "</think>"
ALWAYS_THINKING = ("qwen3-thinking", "deepseek-r1")


def thinks_first(parser: str, req: Any) -> bool:
    """Whether the reply is thinking from its first token (SGLang's force_reasoning)."""
    if parser in ALWAYS_THINKING:
        return True
    return (getattr(req, "chat_template_kwargs", None) or {}).get("enable_thinking", True) is True


@dataclass
class SplitReply:
    reasoning: Optional[str]  # None where the reply holds no thinking
    content: str


def split_reply(text: str, thinking_first: bool) -> SplitReply:
    """SGLang's detect_and_parse: the tags removed, the thinking, and the content after it stripped."""
    if not thinking_first and START not in text:
        return SplitReply(None, text)
    body = text.replace(START, "").strip()
    if END not in body:
        return SplitReply(body, "")
    reasoning, content = body.split(END, 1)
    return SplitReply(reasoning, content.strip())


class StreamedReasoning:
    """A streamed reply's text split as it comes, per choice: reasoning deltas, and the content so
    far (cumulative, for the tool-call parser after it). A reply that need not think first thinks
    only where it begins with `<think>` (decided once its first characters cannot start one)."""

    def __init__(self, thinking_first: bool) -> None:
        self.thinking_first = thinking_first
        self.sent: dict[int, int] = {}  # per choice: characters of its thinking sent
        self.plain: dict[int, bool] = {}  # per choice: decided to hold no thinking

    def delta(self, index: int, text: str, final: bool) -> tuple[str, Optional[str]]:
        """The choice's text so far -> (the new reasoning to send, the content so far, or None while
        it may still be thinking)."""
        if not self.thinking_first and not self.plain.get(index):
            stripped = text.lstrip()
            if not stripped.startswith(START):
                if not final and START.startswith(stripped):
                    return "", None  # "<thi": the tag may be coming
                self.plain[index] = True
        if self.plain.get(index):
            return "", text
        end = text.find(END)
        if end >= 0:
            thinking, content = text[:end], text[end + len(END):].lstrip()
        else:
            thinking, content = text, ("" if final else None)
            if not final:  # a tag arriving in pieces is sent once whole (or dropped, as <think> is)
                thinking = thinking[:len(thinking) - max(tag_start_len(thinking, END), tag_start_len(thinking, START))]
        thinking = thinking.replace(START, "").lstrip()
        new = thinking[self.sent.get(index, 0):]
        self.sent[index] = len(thinking)
        return new, content


def tag_start_len(text: str, tag: str) -> int:
    """How many characters at text's end may be the start of `tag`."""
    for held in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:held]):
            return held
    return 0
