"""A hostile or careless HTTP client: each bad body is a 400 naming the problem (never a 500 or a
hang), and afterwards the engine serves, idle, unpaused, with no KV slot leaked."""

from __future__ import annotations

import json

import pytest

GEN = {"max_new_tokens": 2, "temperature": 0.0}
CHAT = [{"role": "user", "content": "hi"}]


def _serving(client, engine) -> None:
    stats = engine.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.paused) == (0, 0, False)
    engine.check_integrity()
    resp = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN})
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 2


# JSON's \ud800 escape is legal JSON and decodes to a lone surrogate, which the tokenizer cannot
# encode: it was a 500 on all three generation routes
@pytest.mark.parametrize("path,body,message", [
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}',
     "prompt is not valid Unicode text: it has a lone surrogate '\\ud800' at character 0"),
    ("/v1/completions", b'{"prompt": ["ok", "x\\udc00"], "max_tokens": 2}', "lone surrogate '\\udc00' at character 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "the chat messages' text is not valid Unicode text"),
    ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": Infinity}}',
     "temperature must be a finite number, got inf"),
    ("/v1/completions", b'{"prompt": "hi", "repetition_penalty": -Infinity}',
     "repetition_penalty must be a finite number, got -inf"),
    # negative counts are named by the client's own field, not the engine's it maps to
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}',
     "body.top_logprobs: Input should be greater than or equal to 0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}',
     "body.max_completion_tokens: Input should be greater than or equal to 0"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": -1}', "body.logprobs: Input should be greater than or equal to 0"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', "body.max_tokens: Input should be greater than or equal to 0"),
    # a validator's own text, without pydantic's "Value error, " before it
    ("/v1/completions", b'{"prompt": "x", "suffix": "y"}', "body: suffix is not supported: tandem does no fill-in"),
])
def test_bad_text_and_non_finite_floats_are_400(raw, engine, path, body, message):
    resp = raw.post_bytes(path, body)
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["message"]
    _serving(raw, engine)


@pytest.mark.parametrize("body", [
    b'{"text": "hi \xff\xfe", "sampling_params": {"max_new_tokens": 2}}',  # not UTF-8
    "{\"text\": \"caf\u00e9\"}".encode("latin-1"),
    b"[" * 100_000 + b"]" * 100_000,  # nested deeper than json.loads goes
    b'{"input_ids": [' + b"9" * 5000 + b"]}",  # an integer longer than Python parses from text
])
def test_a_body_json_cannot_read_is_400_saying_what_to_send(raw, engine, body):
    """FastAPI's bare {"detail": "There was an error parsing the body"} named nothing, in another
    shape than every other error."""
    resp = raw.post_bytes("/generate", body)
    assert resp.status_code == 400, resp.text
    assert "the body could not be read as JSON: send one UTF-8 JSON object" in resp.json()["message"]
    assert raw.get("/no-such-route").json() == {"detail": "Not Found"}  # other statuses as FastAPI's
    _serving(raw, engine)


@pytest.mark.parametrize("body, why", [(b'{"text": "a"} xx', "Extra data at character 14"),
                                       (b'{"text": "a",', "at character 13")])
def test_malformed_json_is_400_saying_where(raw, engine, body, why):
    resp = raw.post_bytes("/generate", body)
    assert resp.status_code == 400, resp.text
    assert "the body is not valid JSON (" in resp.json()["message"] and why in resp.json()["message"], resp.text
    _serving(raw, engine)


@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {}])
def test_a_json_body_sent_without_its_content_type_is_told_to_send_it(raw, engine, headers):
    """curl -d sends a form's Content-Type: the JSON object was never read as JSON."""
    resp = raw.post("/generate", content=b'{"input_ids": [5, 6]}', headers=headers)
    assert resp.status_code == 400, resp.text
    assert "send the body as JSON with Content-Type: application/json" in resp.json()["message"]
    _serving(raw, engine)


@pytest.mark.parametrize("content_type", ["Application/JSON", "application/json; charset=utf-8",
                                          "application/vnd.api+json"])
def test_a_json_content_type_in_any_spelling_is_not_told_to_send_json(raw, content_type):
    """FastAPI read these as JSON: a field error is only the field's."""
    resp = raw.post("/generate", content=b'{"input_ids": "five"}', headers={"content-type": content_type})
    assert resp.status_code == 400 and "Content-Type" not in resp.json()["message"], resp.text


def test_a_valid_surrogate_pair_is_text(raw, engine):
    resp = raw.post_bytes("/generate", b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}')
    assert resp.status_code == 200, resp.text


def test_start_profile_with_an_unwritable_output_dir_is_400(raw, engine, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    resp = raw.post("/start_profile", json={"output_dir": str(blocker / "traces")})
    assert resp.status_code == 400 and f"output_dir '{blocker / 'traces'}' cannot be created" in resp.json()["message"]
    assert raw.post("/stop_profile").status_code == 400  # nothing was started
    _serving(raw, engine)


@pytest.mark.parametrize("port", [-1, 0, 70000])
def test_init_weights_update_group_with_a_bad_port_names_it(raw, engine, port):
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 1}
    resp = raw.post("/init_weights_update_group", json=body)
    assert resp.status_code == 400
    assert resp.json()["message"].endswith(f"master_port must be a TCP port in [1, 65535]; got {port}")
    _serving(raw, engine)


def test_abort_request_with_an_empty_body_aborts_nothing(raw, engine):
    """{} and {"rid": ""} used to abort every request in flight; SGLang does nothing for them."""
    raw.post("/pause_generation", json={"mode": "in_place"})
    try:
        import threading

        answers = {}
        worker = threading.Thread(target=lambda: answers.update(resp=raw.post(
            "/generate", json={"input_ids": [5, 6], "sampling_params": GEN, "rid": "survivor"})))
        worker.start()
        for _ in range(500):
            if engine.get_stats().num_waiting_reqs == 1:
                break
            threading.Event().wait(0.01)
        assert raw.post("/abort_request", json={}).status_code == 200
        assert raw.post("/abort_request", json={"rid": ""}).status_code == 200
    finally:
        raw.post("/continue_generation")
    worker.join(timeout=30)
    assert answers["resp"].json()["meta_info"]["finish_reason"]["type"] == "length"
    _serving(raw, engine)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_zero_means_zero(raw, engine, field):
    """0 fell through `or` to the default of 128 tokens."""
    resp = raw.post("/v1/chat/completions", json={"messages": CHAT, field: 0})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 0


def test_sampling_params_list_of_non_dicts_is_400(raw, engine):
    resp = raw.post("/generate", json={"text": ["a", "b"], "sampling_params": [GEN, "x"]})
    assert resp.status_code == 400 and "sampling_params" in resp.json()["message"]
    _serving(raw, engine)


# ---- a fuzz over field types: any JSON value in any field is an answer below 500 --------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                     st.sampled_from(["\ud800", "", "abort", "json_object", "user", "text"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=6)
_SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
             "sampling_seed", "json_schema", "regex", "ebnf", "logit_bias", "min_new_tokens", "ignore_eos",
             "repetition_penalty", "stream_interval", "skip_special_tokens", "no_stop_trim"]
_ROUTE_FIELDS = {
    "/generate": ["text", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid",
                  "logprob_distribution", "return_text_in_logprobs", "stream", "token_ids_logprob"],
    "/v1/completions": ["prompt", "max_tokens", "logprobs", "echo", "n", "stop", "seed", "temperature",
                        "response_format", "stream_options", "top_k", "stream"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                             "response_format", "n", "seed", "stop", "stream"],
}
_BASE = {"/generate": {"input_ids": [5, 6], "sampling_params": dict(GEN)},
         "/v1/completions": {"prompt": [5, 6], "max_tokens": 2, "temperature": 0.0},
         "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2, "temperature": 0.0}}


@st.composite
def _bodies(draw):
    path = draw(st.sampled_from(sorted(_ROUTE_FIELDS)))
    body = json.loads(json.dumps(_BASE[path]))
    for field in draw(st.lists(st.sampled_from(_ROUTE_FIELDS[path]), min_size=1, max_size=3, unique=True)):
        body[field] = draw(_VALUES)
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        for field in draw(st.lists(st.sampled_from(_SAMPLING), max_size=2, unique=True)):
            body["sampling_params"][field] = draw(_VALUES)
    if "text" in body or "input_ids" not in body:
        body.pop("input_ids", None)
    for key in ("max_new_tokens", "max_tokens"):  # keep generation short: 2 tokens at most
        target = body.get("sampling_params") if key == "max_new_tokens" else body
        if isinstance(target, dict) and isinstance(target.get(key), int) and not isinstance(target[key], bool):
            target[key] = max(min(target[key], 2), -1)
    return path, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=_bodies())
def test_fuzzed_field_types_never_500(raw, engine, case):
    path, body = case
    text = json.dumps(body, allow_nan=True)  # NaN / Infinity as Python's json writes them
    resp = raw.post_bytes(path, text.encode("utf-8", "surrogatepass"))
    assert resp.status_code < 500, (path, body, resp.status_code, resp.text)
    if resp.status_code == 400:
        assert resp.json()["message"], (path, body)


def test_after_the_fuzz_the_engine_is_clean(raw, engine):
    _serving(raw, engine)


def _nested(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize("path,body,message", [
    # 460 groups: re parsed it, the core's `regex` could not (a failed step, its batch aborted);
    # 500: re's parser itself (a 500)
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop_regex": "(" * 460 + "a" + ")" * 460}},
     "stop_regex is nested too deeply"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stop_regex": "(" * 500 + "a" + ")" * 500},
     "stop_regex is nested too deeply"),
    # 600 levels: json.loads took it, pickling it to the core did not (a 500)
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "custom_params": _nested(600)}},
     "custom_params must be nested at most 64 levels deep; it nests deeper"),
])
def test_deeply_nested_fields_are_400_naming_them(raw, engine, path, body, message):
    resp = raw.post_bytes(path, json.dumps(body).encode())
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["message"]
    _serving(raw, engine)


def test_a_recursion_error_anywhere_in_a_request_is_its_400(raw, engine, monkeypatch):
    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded while pickling an object")

    monkeypatch.setattr(engine.builder, "build", too_deep)
    resp = raw.post_bytes("/generate", json.dumps({"input_ids": [5, 6], "sampling_params": GEN}).encode())
    monkeypatch.undo()
    assert resp.status_code == 400 and "nested too deeply" in resp.json()["message"], resp.text
    _serving(raw, engine)


@pytest.mark.parametrize("extra,message", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]},
     'a text content part needs its text as a string: {"type": "text", "text": "..."}; got [\'txt\', \'type\']'),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "with text 5"),
    ({"tools": [{"type": "function", "function": {"name": "get"}}], "tool_choice": {"type": "function", "function": "get"}},
     'a named tool_choice is {"type": "function", "function": {"name": '),
    ({"tools": [{"type": "function", "function": {"name": "get"}}], "tool_choice": {"type": "function"}},
     'a named tool_choice is'),
    ({"response_format": {"type": "structural_tag", "structures": "x", "triggers": 5}},
     'structural_tag: "structures" must be a list of {"begin": str, "schema": JSON schema, "end": str}'),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": [5]}},
     'structural_tag: "triggers" must be a list of strings'),
])
def test_a_misshapen_chat_field_is_named_by_its_shape(raw, engine, extra, message):
    """These named the wrong problem ("got type 'text'", "names tool None") or leaked a TypeError."""
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    resp = raw.post_bytes("/v1/chat/completions", json.dumps(body).encode())
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["message"], resp.json()["message"]
    _serving(raw, engine)
