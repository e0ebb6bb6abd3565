"""How a chat template takes a message's content: one string, or OpenAI's list of parts.

Clients send content as a string or as parts ([{"type": "text", "text": ...}]). A template written
for strings (Qwen3's, DeepSeek's: `message.content is string`) gets the parts' texts joined by a
space, as SGLang hands them over; a template that loops over `message.content` (Llama-4's, the
vision models') gets the parts as they came. Which one a template is, is read from its Jinja AST
once per template text.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional

ContentFormat = Literal["string", "openai"]
MESSAGE_NAMES = ("message", "msg", "m")  # what templates call the loop's message
MULTIMODAL_WORDS = ("image", "audio", "video", "vision")  # templates that render parts of these kinds


def template_content_format(tokenizer: Any, template_kwargs: Optional[dict] = None) -> ContentFormat:
    """The format of the template a request renders with: its own chat_template, else the tokenizer's."""
    template = (template_kwargs or {}).get("chat_template") or getattr(tokenizer, "chat_template", None)
    return content_format(template) if isinstance(template, str) else "string"


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    if any(word in template for word in MULTIMODAL_WORDS):
        return "openai"
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:  # rendering it will say what is wrong
        return "string"
    loops = tree.find_all(nodes.For)
    return "openai" if any(_reads_content(loop.iter) for loop in loops) else "string"


def _reads_content(node: Any) -> bool:
    """node is `message.content` / `message['content']`, possibly filtered, tested or sliced."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
        if node is None:
            return False
    if isinstance(node, nodes.Getattr):
        key = node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key = node.arg.value
    else:
        return False
    return key == "content" and isinstance(node.node, nodes.Name) and node.node.name in MESSAGE_NAMES


def joined_text(content: Any) -> Any:
    """Text parts as one string, their texts joined by a space (SGLang's); a string as it is."""
    if not isinstance(content, list):
        return content
    return " ".join(part["text"] for part in content)
