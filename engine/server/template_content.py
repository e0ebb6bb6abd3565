"""How a chat template takes a message's content: one string, or OpenAI's list of parts.

Clients send content as a string or as parts ([{"type": "text", "text": ...}]). A template written
for strings (Qwen3's, DeepSeek's: `message.content is string`) gets the parts' texts joined by a
space, as SGLang hands them over; a template that loops over a message's content (Llama-4's,
Gemma-3's) gets the parts as they came. Which one a template is, is read once per template text
from its Jinja AST, parsed in the environment transformers renders it in (its extensions:
{% break %}, {% generation %}): a loop over `<anything>.content`, or over a name set from one.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional

ContentFormat = Literal["string", "openai"]


def template_content_format(tokenizer: Any, template_kwargs: Optional[dict] = None) -> ContentFormat:
    """The format of the template a request renders with: its own chat_template, else the
    tokenizer's (of named templates, the one transformers picks by default)."""
    template = (template_kwargs or {}).get("chat_template") or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return content_format(template) if isinstance(template, str) else "string"


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    from jinja2 import nodes

    tree = _parsed(template)
    if tree is None:  # rendering it will say what is wrong
        return "string"
    content_names = {assign.target.name for assign in tree.find_all(nodes.Assign)
                     if isinstance(assign.target, nodes.Name) and _is_content(_unwrapped(assign.node))}
    for loop in tree.find_all(nodes.For):
        source = _unwrapped(loop.iter)
        if _is_content(source) or (isinstance(source, nodes.Name) and source.name in content_names):
            return "openai"
    return "string"


def _parsed(template: str) -> Any:
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
    except Exception:  # an older transformers, or a template it cannot compile
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return environment.parse(template)
    except jinja2.TemplateSyntaxError:
        return None


def _unwrapped(node: Any) -> Any:
    """node without the filters, tests and slices around it: `message.content | list` -> `message.content`."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    return node


def _is_content(node: Any) -> bool:
    """`x.content` or `x['content']`."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"


def joined_text(content: Any) -> Any:
    """Text parts as one string, their texts joined by a space (SGLang's); a string as it is."""
    if not isinstance(content, list):
        return content
    return " ".join(part["text"] for part in content)
