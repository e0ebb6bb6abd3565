"""tool_choice "required" and a named function, as SGLang serves them (serving_chat with
function_call get_json_schema_constraint): the reply is constrained to a JSON array of
{"name", "parameters"} and comes back as message.tool_calls (arguments a JSON string that
satisfies the tool's schema), finish_reason "tool_calls". Oracle: the tools' own schemas, and the
constrained text itself (the calls are exactly what the model wrote)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from engine.server.forced_tool_calls import forced_call_schema, parse_calls
from engine.server.http import create_app
from tests.server.test_openai_client_bodies import TEMPLATE

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
USER = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def client(engine_factory):
    eng = engine_factory()
    eng.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(eng)) as c:
        yield c


def _chat(client, **body):
    resp = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 300,
                                                     "temperature": 1.0, "seed": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _check_calls(calls, names):
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        assert call["function"]["name"] in names
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(args) == {"unit"} and args["unit"] in ("c", "f")
        else:
            assert args == {}


@pytest.mark.parametrize("choice,names", [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})])
def test_forced_choice_comes_back_as_tool_calls(client, choice, names):
    out = _chat(client, tool_choice=choice)
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None and out["matched_stop"] is None
    _check_calls(out["message"]["tool_calls"], names)
    one = _chat(client, tool_choice=choice, parallel_tool_calls=False)
    assert len(one["message"]["tool_calls"]) == 1
    _check_calls(one["message"]["tool_calls"], names)


def test_auto_stays_free_text_and_the_requests_own_grammar_wins(client):
    auto = _chat(client, tool_choice="auto", max_tokens=8)
    assert auto["message"]["tool_calls"] is None and isinstance(auto["message"]["content"], str)
    own = _chat(client, tool_choice="required", max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}})
    assert own["message"]["tool_calls"] is None  # SGLang: the request's constraint, not the tools'
    assert json.loads(own["message"]["content"])["unit"] in ("c", "f")


def test_streamed_forced_calls_arrive_in_one_delta(client):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 300, "temperature": 1.0, "seed": 1, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert all(d["delta"].get("content") is None for d in deltas)  # no JSON text leaks as content
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert len(calls) == 1 and deltas[-1]["finish_reason"] == "tool_calls"
    _check_calls(calls, {"get_weather", "get_time"})
    # the role, then the calls: no empty deltas while the array was generated
    assert len(deltas) == 2 and deltas[0]["delta"]["role"] == "assistant" and not deltas[0]["delta"].get("tool_calls")


def test_required_without_tools_is_refused(client):
    resp = client.post("/v1/chat/completions", json={"messages": USER, "tool_choice": "required"})
    assert resp.status_code == 400 and "needs tools" in resp.json()["message"]


def test_schema_and_parse_follow_sglang():
    from engine.server.chat_messages import ChatTool

    tools = [ChatTool.model_validate(t) for t in TOOLS]
    schema = forced_call_schema(tools, "required", parallel_tool_calls=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert forced_call_schema(tools, NAMED)["items"]["properties"]["parameters"]["additionalProperties"] is False
    assert forced_call_schema(tools, "auto") is None and forced_call_schema(tools, None) is None
    assert parse_calls('[{"name": "f", "parameters": {"a": "é"}}]')[0]["function"]["arguments"] == '{"a": "é"}'
    assert parse_calls('[{"name": "f", "parameters": {') is None  # cut by max_tokens: stays content
    assert parse_calls('{"name": "f"}') is None
    # pydantic-style parameters refer to "#/$defs/...": hoisted to the array's root (SGLang's too)
    unit = {"enum": ["c", "f"]}
    ref_tools = [ChatTool.model_validate({"function": {"name": n, "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}})
        for n in ("a", "b")]
    assert forced_call_schema(ref_tools, "required")["$defs"] == {"Unit": unit}
    clash = ref_tools + [ChatTool.model_validate({"function": {"name": "c", "parameters": {"$defs": {"Unit": {}}}}})]
    with pytest.raises(ValueError, match="Unit"):
        forced_call_schema(clash, "required")


def test_referenced_definitions_compile_and_constrain(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
        "additionalProperties": False, "$defs": {"Unit": {"enum": ["c", "f"]}}}}}]
    out = _chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert out["finish_reason"] == "tool_calls"
    _check_calls(out["message"]["tool_calls"], {"get_weather"})
