"""--reasoning-parser: a chat reply's <think>...</think> as reasoning_content (SGLang's
detect_and_parse: tags removed, a reply cut while thinking all reasoning), streamed as reasoning
deltas then content deltas that join to the same split, with the tool-call parser after it; a
request's separate_reasoning false keeps the text whole. The route tests make the tiny model write
the text with a regex constraint: the oracle is that text."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from engine.server.reasoning_parser import StreamedReasoning, split_reply, thinks_first

THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\nSure."


@pytest.mark.parametrize("first, text, reasoning, content", [
    (True, THOUGHT, "The user wants Paris.\n", "Sure."),
    (True, "Let me think.</think>Sure.", "Let me think.", "Sure."),  # the template opened <think>
    (True, "<think>\nstill going", "still going", ""),  # cut by max_tokens while thinking
    (False, THOUGHT, "The user wants Paris.\n", "Sure."),  # qwen3, enable_thinking false: only if it opens one
    (False, "Sure.", None, "Sure."),
])
def test_split_is_sglang_s(first, text, reasoning, content):
    split = split_reply(text, first)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_which_replies_think_first_follows_sglang():
    plain, off = SimpleNamespace(chat_template_kwargs=None), SimpleNamespace(chat_template_kwargs={"enable_thinking": False})
    assert thinks_first("qwen3", plain) and not thinks_first("qwen3", off)
    assert thinks_first("deepseek-r1", off) and thinks_first("qwen3-thinking", off)


def _streamed(first: bool, pieces: list[str]) -> tuple[str, str]:
    stream, reasoning, content, text = StreamedReasoning(first), "", "", ""
    for i, piece in enumerate(pieces):
        text += piece
        new, body = stream.delta(0, text, i == len(pieces) - 1)
        reasoning += new
        content = body if body is not None else content
    return reasoning, content


@pytest.mark.parametrize("first, text", [(True, THOUGHT), (False, THOUGHT), (False, "Sure, <thinking> is a word."),
                                         (True, "a\n</think>b"), (True, "<think>cut"), (False, "<think>cut")])
def test_a_stream_joins_to_the_split_whatever_the_pieces(first, text):
    split = split_reply(text, first)
    for size in (1, 2, 3, 5, 7, len(text)):  # tags cut anywhere across chunks
        reasoning, content = _streamed(first, [text[i:i + size] for i in range(0, len(text), size)])
        assert reasoning == (split.reasoning or "") and content.strip() == split.content, size


# ---- through the route --------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(engine_factory):
    pytest.importorskip("xgrammar")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app
    from tests.server.test_openai_client_bodies import TEMPLATE

    eng = engine_factory(reasoning_parser="deepseek-r1", tool_call_parser="qwen25")
    eng.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(eng)) as c:
        yield c


def _body(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200, "temperature": 0,
            "regex": re.escape(text), **extra}


def test_thinking_then_a_call(client):
    choice = client.post("/v1/chat/completions", json=_body(THOUGHT + " " + CALL, tools=TOOLS)).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "The user wants Paris.\n" and message["content"] == "Sure."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls"
    whole = client.post("/v1/chat/completions", json=_body(THOUGHT, separate_reasoning=False)).json()["choices"][0]
    assert whole["message"]["content"] == THOUGHT and whole["message"]["reasoning_content"] is None


def test_a_streamed_reply_sends_thinking_then_content_then_calls(client):
    with client.stream("POST", "/v1/chat/completions", json=_body(THOUGHT + " " + CALL, tools=TOOLS,
                                                                  stream=True)) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert reasoning == "The user wants Paris.\n" and content.strip() == "Sure."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["get_weather"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
