"""--reasoning-parser: a chat reply's <think>...</think> as reasoning_content (SGLang's
detect_and_parse: tags removed, a reply cut while thinking all reasoning), streamed as reasoning
deltas then content deltas that join to the same split, with the tool-call parser after it; a
request's separate_reasoning false keeps the text whole. The route tests make the tiny model write
the text with a regex constraint: the oracle is that text."""

from __future__ import annotations

import json
import re

import pytest

from engine.server.reasoning_parser import StreamedReasoning, split_reply

THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\nSure."


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", THOUGHT, "The user wants Paris.\n", "Sure."),
    ("qwen3", "Sure.", None, "Sure."),  # thinking off: no tag, all content
    ("qwen3", "<think>\nstill going", "still going", ""),  # cut by max_tokens while thinking
    ("qwen3-thinking", "The user wants Paris.\n</think>\nSure.", "The user wants Paris.\n", "Sure."),
    ("deepseek-r1", "no end yet", "no end yet", ""),
])
def test_split_is_sglang_s(parser, text, reasoning, content):
    split = split_reply(text, parser)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("parser, text", [("qwen3", THOUGHT), ("qwen3", "Sure, <thinking> is a word."),
                                          ("qwen3-thinking", "a\n</think>b"), ("qwen3", "<think>cut")])
def test_a_stream_joins_to_the_split(parser, text):
    stream, reasoning, content = StreamedReasoning(parser), "", ""
    for end in range(1, len(text) + 1):
        new, body = stream.delta(0, text[:end], end == len(text))
        reasoning += new
        content = body if body is not None else content
    split = split_reply(text, parser)
    assert reasoning.strip() == (split.reasoning or "").strip() and content.strip() == split.content


# ---- through the route --------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(engine_factory):
    pytest.importorskip("xgrammar")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app
    from tests.server.test_openai_client_bodies import TEMPLATE

    eng = engine_factory(reasoning_parser="qwen3", tool_call_parser="qwen25")
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
