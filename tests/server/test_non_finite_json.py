"""Non-finite floats in replies: a masked token's processed logprob is -inf, a degenerate
distribution's NaN. Replies and stream events write them as null (FastAPI's rule, SGLang's orjson
too), so strict JSON parsers (json.loads refusing NaN / Infinity) read every event."""

from __future__ import annotations

import json

import pytest

from engine.server.sse import json_bytes, sse_event


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_events_and_replies_write_non_finite_floats_as_null():
    payload = {"a": float("nan"), "b": [float("-inf"), 1.5, float("inf")], "c": "x"}
    assert _strict(sse_event(payload)[len("data: "):]) == {"a": None, "b": [None, 1.5, None], "c": "x"}
    assert sse_event(payload).endswith("\n\n")
    assert _strict(json_bytes(payload).decode()) == {"a": None, "b": [None, 1.5, None], "c": "x"}


def test_a_streamed_masked_tokens_logprob_is_null(client):
    pytest.importorskip("xgrammar")
    body = {"text": "hi", "stream": True, "return_logprob": True, "logprob_distribution": "processed",
            "token_ids_logprob": [5, 67], "sampling_params": {"max_new_tokens": 2, "regex": "a+", "temperature": 0}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [_strict(e) for e in events[:-1]]
    entries = [entry for chunk in chunks for step in chunk["meta_info"]["output_token_ids_logprobs"] for entry in step]
    assert any(entry[0] is None for entry in entries)  # a token the grammar masks: -inf, sent as null
