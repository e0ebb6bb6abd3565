"""--tool-call-parser qwen25: `<tool_call>{"name", "arguments"}</tool_call>` blocks in a chat reply
come back as message.tool_calls with tool_choice auto (finish_reason "tool_calls"), streamed too
(the text before a call as it comes, the calls in the last delta); anything that is not a call
of one of the request's tools stays the content. The route tests make the tiny model write the
blocks with a regex constraint: the oracle is the text it was made to write."""

from __future__ import annotations

import json
import time

import pytest

from engine.server.tool_call_parser import CLOSE, OPEN, StreamedCalls, parse_reply, streamable_len

NAMES = {"get_weather", "get_time"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def test_blocks_of_known_tools_are_calls_and_the_rest_content():
    parsed = parse_reply(f"Let me check.\n{CALL}\n<tool_call>{{\"name\": \"get_time\"}}</tool_call>", NAMES)
    assert parsed.content == "Let me check."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == \
        [(0, "get_weather", {"city": "Paris", "unit": "c"}), (1, "get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.calls)
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
                 "<tool_call>{not json}</tool_call>", '<tool_call>{"name": ["x"]}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": {'):  # cut by max_tokens
        assert parse_reply(text, NAMES).calls == [] and parse_reply(text, NAMES).content == text


def test_a_reply_of_whitespace_parses_in_linear_time():
    """A lazy regex between whitespace runs took 3.3 s for 2,000 spaces and 211 s for 8,000 (cubic),
    holding the GIL: the server stopped answering."""
    start = time.perf_counter()
    for text in (OPEN + " " * 50_000, OPEN + " " * 50_000 + CLOSE, (OPEN + " ") * 10_000):
        assert parse_reply(text, NAMES).calls == [] and streamable_len(text) == 0
    assert time.perf_counter() - start < 2.0


def test_a_stream_holds_back_from_the_first_call():
    assert streamable_len("Sure, <tool_") == len("Sure, ") and streamable_len("a < b") == 5
    assert streamable_len(f"x{CALL}") == 1
    stream, sent = StreamedCalls(NAMES), []
    text = f"Checking. {CALL} done"
    for end in range(1, len(text)):
        piece, extra, reason = stream.delta(0, text[:end], None)
        assert extra == {} and reason is None
        sent.append(piece)
    content, extra, reason = stream.delta(0, text, "stop")
    assert "".join(sent) == "Checking. " and content == "done" and reason == "tool_calls"
    assert json.loads(extra["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    plain = StreamedCalls(NAMES)
    assert plain.delta(0, "a <tool", None)[0] == "a " and plain.delta(0, "a <tool>", "length") == ("<tool>", {}, "length")


# ---- through the route --------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in sorted(NAMES)]


@pytest.fixture(scope="module")
def client(engine_factory):
    pytest.importorskip("xgrammar")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app
    from tests.server.test_openai_client_bodies import TEMPLATE

    eng = engine_factory(tool_call_parser="qwen25")
    eng.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(eng)) as c:
        yield c


def _body(**extra) -> dict:
    import re

    return {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS, "max_tokens": 200,
            "temperature": 0, "regex": re.escape("On it. " + CALL), **extra}


def test_the_reply_s_calls_come_back_as_tool_calls(client):
    choice = client.post("/v1/chat/completions", json=_body()).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "On it."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    none = client.post("/v1/chat/completions", json=_body(tool_choice="none")).json()["choices"][0]
    assert none["message"]["tool_calls"] is None and none["message"]["content"] == "On it. " + CALL


def test_a_streamed_reply_sends_its_calls_last(client):
    with client.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert content == "On it. " and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
