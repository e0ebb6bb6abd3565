"""OpenAI content parts reach the chat template as SGLang hands them over: joined by a space for a
template of strings (the tiny model's, Qwen3's), as a list for a template that loops over them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.server.chat_messages import ChatMessage
from engine.server.http import create_app
from engine.server.template_content import content_format

PARTS = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
QWEN_LIKE = ("{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
             "{%- else %}{%- set content = '' %}{%- endif %}<|im_start|>{{ message.role }}\n{{ content }}<|im_end|>\n"
             "{%- endfor %}")
LOOPS_PARTS = ("{% for message in messages %}{{ message['role'] }}:{% for part in message['content'] %}"
               "[{{ part['text'] }}]{% endfor %}\n{% endfor %}")


@pytest.mark.parametrize("template, want", [
    (QWEN_LIKE, "string"),
    (LOOPS_PARTS, "openai"),
    ("{% for m in messages %}{% for c in m.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
     "{% endfor %}{% endfor %}", "openai"),  # filtered, attribute access, `m`
    ("{% for message in messages %}{% for x in message.tool_calls %}{{ x }}{% endfor %}{% endfor %}", "string"),
    ("{% for turn in messages %}{% for p in turn['content'] %}{{ p.text }}{% break %}{% endfor %}{% endfor %}",
     "openai"),  # any loop name; transformers' loop controls parse
    ("{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),  # a loop over a name set from the content
    ("{#- a revision with images and vision -#}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "string"),  # words in a comment say nothing
    ("{% for message in messages %", "string"),  # does not parse: rendering says so
])
def test_a_template_is_read_as_taking_strings_or_parts(template, want):
    assert content_format(template) == want


def test_named_templates_are_read_by_their_default():
    from types import SimpleNamespace

    from engine.server.template_content import template_content_format

    named = SimpleNamespace(chat_template={"default": LOOPS_PARTS, "tool_use": QWEN_LIKE})
    assert template_content_format(named) == "openai"
    assert template_content_format(named, {"chat_template": QWEN_LIKE}) == "string"  # the request's own wins
    assert template_content_format(SimpleNamespace(chat_template=None)) == "string"


def test_parts_are_joined_by_a_space_for_a_template_of_strings_and_kept_for_one_of_parts():
    msg = ChatMessage(role="user", content=PARTS)
    assert msg.template_dict(0)["content"] == "hi there"
    assert msg.template_dict(0, "openai")["content"] == PARTS
    assert ChatMessage(role="user", content="plain").template_dict(0, "openai")["content"] == "plain"
    with pytest.raises(ValueError, match="only text content parts"):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])


def test_chat_and_tokenize_render_parts_as_the_joined_text(engine):
    from engine.tokenizer import apply_chat_template

    want = apply_chat_template(engine.tokenizer, [{"role": "user", "content": "hi there"}])
    assert want != apply_chat_template(engine.tokenizer, [{"role": "user", "content": "hithere"}])
    with TestClient(create_app(engine)) as c:
        tokens = c.post("/tokenize", json={"messages": [{"role": "user", "content": PARTS}]}).json()["tokens"]
        assert tokens == want
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PARTS}],
                                                    "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(want)
        cont = c.post("/tokenize", json={"messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": PARTS}],
                                         "continue_final_message": True, "add_generation_prompt": False}).json()
        assert cont["tokens"] == apply_chat_template(engine.tokenizer, [{"role": "user", "content": "q"}],
                                                     assistant_prefix="hi there")


def test_a_template_of_parts_gets_them_as_a_list(engine):
    from engine.server.openai import _chat_prompt_ids
    from engine.server.openai_protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": PARTS}], chat_template=LOOPS_PARTS)
    ids = _chat_prompt_ids(engine.tokenizer, req, None, lambda text, what: None)
    assert engine.tokenizer.decode(ids) == "user:[hi][there]"  # Jinja drops the template's last newline
