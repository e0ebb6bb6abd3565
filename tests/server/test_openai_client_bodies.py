"""OpenAI-route bodies that tandem once refused or rendered short: tools and tool-call history for
the chat template, continue_final_message, SGLang's matched_stop, nulls for unset fields, the
"function" role and case-insensitive roles (SGLang's serving_chat.py / protocol.py; the openai
package's chat.completions and completions bodies). Oracle: the template rendered here, and the
in-process engine on the same ids."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.server.http import create_app
from engine.tokenizer import apply_chat_template

# renders tools, tool calls (arguments as an object, as HF templates expect) and tool results
TEMPLATE = (
    "{%- if tools %}{{- 'TOOLS:' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}"
    "{%- if reasoning_effort is defined %}{{- 'EFFORT:' + reasoning_effort }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- for c in m.tool_calls or [] %}{{- c.function.name + '(' + c.function.arguments.city + ')' }}{%- endfor %}"
    "{%- if m.tool_call_id is defined %}{{- '[' + m.tool_call_id + ']' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "the time"}}]
USER = [{"role": "user", "content": "weather in Paris?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def chat(engine_factory):
    eng = engine_factory()
    eng.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(eng)) as c:
        yield c, eng


def _prompt_tokens(c, **body) -> int:
    resp = c.post("/v1/chat/completions", json={"max_tokens": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_tools_reach_the_template_as_sent(chat):
    c, eng = chat
    tok = eng.tokenizer
    assert _prompt_tokens(c, messages=USER, tools=TOOLS) == len(apply_chat_template(tok, USER, tools=TOOLS))
    assert _prompt_tokens(c, messages=USER, tools=TOOLS) > _prompt_tokens(c, messages=USER)
    assert _prompt_tokens(c, messages=USER, tools=TOOLS, tool_choice="none") == _prompt_tokens(c, messages=USER)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _prompt_tokens(c, messages=USER, tools=TOOLS, tool_choice=named) == len(
        apply_chat_template(tok, USER, tools=TOOLS[1:]))
    missing = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                   "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert missing.status_code == 400 and "tool_choice names tool 'x'" in missing.json()["message"]
    no_tools = c.post("/v1/chat/completions", json={"messages": USER, "tool_choice": named})  # was a 200, ignored
    assert no_tools.status_code == 400 and "the request has no tools" in no_tools.json()["message"]
    bad = c.post("/v1/chat/completions", json={"messages": USER, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and "tools.0.function" in bad.json()["message"]


def test_tool_call_history_reaches_the_template(chat):
    """The openai package's follow-up turn: an assistant message with tool_calls (arguments a JSON
    string, content null) and a tool message with tool_call_id."""
    c, eng = chat
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    sent = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    seen = USER + [{"role": "assistant", "content": "", "tool_calls": [parsed]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = apply_chat_template(eng.tokenizer, seen)
    assert "get_weather(Paris)" in eng.tokenizer.decode(ids) and "[call_1]" in eng.tokenizer.decode(ids)
    out = c.post("/v1/chat/completions", json={"messages": sent, "max_tokens": 4, **GREEDY}).json()
    assert out["usage"]["prompt_tokens"] == len(ids)
    direct = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, **GREEDY})
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": direct["text"], "reasoning_content": None, "tool_calls": None}
    call["function"]["arguments"] = "not json"
    bad = c.post("/v1/chat/completions", json={"messages": sent})
    assert bad.status_code == 400 and "messages[1].tool_calls" in bad.json()["message"]
    for field, value, says in (("tool_calls", "x", "tool_calls must be a list of objects"),
                               ("tool_calls", [1], "tool_calls must be a list of objects"),
                               ("tool_calls", [{"function": "f"}], "function must be an object"),
                               ("tool_call_id", 7, "tool_call_id must be a string"),
                               ("name", ["a"], "name must be a string")):
        wrong = USER + [{"role": "assistant", "content": "hi", field: value}]
        bad = c.post("/v1/chat/completions", json={"messages": wrong, "max_tokens": 1})
        assert bad.status_code == 400 and says in bad.json()["message"], (field, value, bad.json())
    assert c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_continue_final_message_continues_the_assistant_text(chat):
    c, eng = chat
    prefix = "The weather is"
    body = {"messages": USER + [{"role": "assistant", "content": prefix}], "continue_final_message": True,
            "max_tokens": 3, **GREEDY}
    out = c.post("/v1/chat/completions", json=body).json()
    ids = apply_chat_template(eng.tokenizer, USER, assistant_prefix=prefix)
    assert eng.tokenizer.decode(ids).endswith("<|im_start|>assistant\n" + prefix)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == eng.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 3, **GREEDY})["text"]


def test_reasoning_effort_reaches_the_template(chat):
    c, eng = chat
    assert _prompt_tokens(c, messages=USER, reasoning_effort="low") == len(
        apply_chat_template(eng.tokenizer, USER, reasoning_effort="low"))


def test_function_role_and_case_insensitive_roles(chat):
    c, eng = chat
    sent = [{"role": "User", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]
    seen = [{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]
    assert _prompt_tokens(c, messages=sent) == len(apply_chat_template(eng.tokenizer, seen))
    empty = c.post("/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and "messages" in empty.json()["message"]


def test_nulls_mean_the_defaults(client):
    """Wrappers serialise unset fields as null; OpenAI marks them nullable."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stop", "stream", "seed", "presence_penalty",
                           "frequency_penalty", "logit_bias", "response_format", "stream_options", "user"])
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True, **nulls,
        "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None, "max_completion_tokens": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["usage"]["completion_tokens"] == 3
    comp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None, "logprobs": None,
                                                "echo": None, "ignore_eos": True, **nulls})
    assert comp.status_code == 200, comp.text
    choice = comp.json()["choices"][0]
    assert choice["logprobs"] is None and comp.json()["usage"]["completion_tokens"] == 16  # OpenAI's default


def test_matched_stop_names_the_stop(client, engine):
    """SGLang's choices[i].matched_stop: the stop string, or the stop token id, that ended it."""
    free = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8, **GREEDY})
    stop = free["text"][2:4]
    body = {"prompt": [5, 6, 7], "max_tokens": 8, **GREEDY}
    by_text = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert by_text["finish_reason"] == "stop" and by_text["matched_stop"] == stop
    tok = free["output_ids"][3]
    by_id = client.post("/v1/completions", json={**body, "stop_token_ids": [tok]}).json()["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["matched_stop"] == tok
    by_length = client.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]
    assert by_length["finish_reason"] == "length" and by_length["matched_stop"] is None
    ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": "hi"}])
    chat_tok = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})["output_ids"][2]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop_token_ids": [chat_tok], **GREEDY}
    want = chat_tok
    assert client.post("/v1/chat/completions", json=chat).json()["choices"][0]["matched_stop"] == want
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    final = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"] is not None]
    assert len(final) == 1 and final[0]["matched_stop"] == want


def test_rid_names_the_request_for_abort_request(engine_factory, live_server_factory):
    """SGLang's OpenAI routes take rid, so a client can abort a chat turn it started."""
    eng = engine_factory()
    server = live_server_factory(eng)
    out: list = []
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "ignore_eos": True, "rid": "turn-9"}
    thread = threading.Thread(target=lambda: out.append(httpx.post(f"{server.url}/v1/chat/completions", json=body,
                                                                   timeout=60)))
    thread.start()
    deadline = time.monotonic() + 20
    while eng.get_stats().num_running_reqs < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "turn-9"}).status_code == 200
    thread.join(30)
    choice = out[0].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < out[0].json()["usage"]["completion_tokens"] < 3000
