"""--reasoning-parser (SGLang's names): a chat reply's thinking, `<think>...</think>`, comes back
as the message's reasoning_content and the rest as its content.

"qwen3": the reply is thinking only where it opens `<think>` (Qwen3 with thinking off writes none);
"qwen3-thinking" and "deepseek-r1": the template opened it in the prompt, so the reply is thinking
until `</think>`. A reply cut inside its thinking is all reasoning_content, as SGLang's detector
gives it. A streamed reply sends the thinking as reasoning_content deltas and the rest as content
as they come, holding back only a tail that may be the start of a tag. A request's
`separate_reasoning: false` (SGLang's) keeps the whole text as the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

START, END = "<think>", "</think>"
OPENED_IN_PROMPT = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}


@dataclass
class SplitReply:
    reasoning: Optional[str]  # None where the reply holds no thinking
    content: str


def split_reply(text: str, parser: str) -> SplitReply:
    """SGLang's detect_and_parse: the tags removed, the thinking, and the content after it stripped."""
    if not OPENED_IN_PROMPT[parser] and START not in text:
        return SplitReply(None, text)
    body = text.replace(START, "").strip()
    if END not in body:
        return SplitReply(body, "")
    reasoning, content = body.split(END, 1)
    return SplitReply(reasoning, content.strip())


class StreamedReasoning:
    """A streamed reply's text split as it comes, per choice: reasoning deltas, and the content so
    far (cumulative, for the tool-call parser after it). With "qwen3" a reply thinks only where it
    begins with `<think>` (decided once its first characters cannot start one)."""

    def __init__(self, parser: str) -> None:
        self.opened = OPENED_IN_PROMPT[parser]
        self.sent: dict[int, int] = {}  # per choice: characters of its thinking sent
        self.plain: dict[int, bool] = {}  # per choice: decided to hold no thinking

    def delta(self, index: int, text: str, final: bool) -> tuple[str, Optional[str]]:
        """The choice's text so far -> (the new reasoning to send, the content so far, or None while
        it may still be thinking)."""
        if not self.opened and not self.plain.get(index):
            stripped = text.lstrip()
            if not stripped.startswith(START):
                if not final and START.startswith(stripped):
                    return "", None  # "<thi": the tag may be coming
                self.plain[index] = True
        if self.plain.get(index):
            return "", text
        begin = text.find(START) + len(START) if START in text else 0
        end = text.find(END, begin)
        if end >= 0:
            thinking, content = text[begin:end], text[end + len(END):].lstrip()
        else:
            thinking, content = text[begin:], ("" if final else None)
            if not final:
                thinking = thinking[:len(thinking) - _held(thinking, END)]
        thinking = thinking.lstrip()
        new = thinking[self.sent.get(index, 0):]
        self.sent[index] = len(thinking)
        return new, content


def _held(text: str, tag: str) -> int:
    """How many characters at text's end may be the start of `tag`."""
    for held in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:held]):
            return held
    return 0
