"""Limits and malformed input: every one is a 4xx naming the problem (never a 500), refused
before anything runs, and the server keeps serving."""

from __future__ import annotations

import base64
import time

import pytest
import torch
from fastapi.testclient import TestClient

from engine.server.http import create_app

GEN = {"max_new_tokens": 2, "temperature": 0.0}


def idle(engine) -> bool:
    stats = engine.get_stats()
    return stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


@pytest.fixture(scope="module")
def small(engine_factory):
    """An engine with small limits, under TestClient."""
    eng = engine_factory(max_n=4, max_batch_requests=6, max_generate_body_bytes=2000, max_body_bytes=4000,
                         max_control_body_bytes=1000)
    with TestClient(create_app(eng)) as c:
        yield eng, c


def test_n_and_batch_limits(small):
    eng, c = small
    over_n = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {**GEN, "n": 5}})
    assert over_n.status_code == 400 and "--max-n" in over_n.json()["message"]
    assert c.post("/v1/completions", json={"prompt": [5, 6], "n": 5}).status_code == 400
    over_batch = c.post("/generate", json={"input_ids": [[5, 6]] * 4, "sampling_params": {**GEN, "n": 2}})
    assert over_batch.status_code == 400 and "--max-batch-requests" in over_batch.json()["message"]
    assert idle(eng)
    with pytest.raises(ValueError, match="--max-n"):  # the in-process API has the same limits
        eng.generate(input_ids=[5, 6], sampling_params={**GEN, "n": 5})
    ok = c.post("/generate", json={"input_ids": [[5, 6]] * 3, "sampling_params": {**GEN, "n": 2}})
    assert ok.status_code == 200 and len(ok.json()) == 6


def test_body_size_limits(small):
    eng, c = small
    big = {"input_ids": [5] * 1000, "sampling_params": GEN}  # ~3 kB of JSON: over the generate limit
    resp = c.post("/generate", json=big)
    assert resp.status_code == 413 and "--max-generate-body-bytes" in resp.json()["message"]
    chunked = c.post("/generate", content=iter([b'{"input_ids": [', b"5, " * 1000, b"5]}"]),
                     headers={"content-type": "application/json"})  # no Content-Length
    assert chunked.status_code == 413
    payload = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["A" * 5000]})
    assert payload.status_code == 413 and "--max-body-bytes" in payload.json()["message"]  # the tensor routes' limit
    under = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["A" * 3000]})
    assert under.status_code == 400  # read and parsed (not a payload): past the control routes' 1000
    for path in ("/abort_request", "/pause_generation", "/update_weights_from_distributed", "/no_such_route"):
        control = c.post(path, json={"rid": "x", "junk": [0] * 1000})  # ~3 kB: the control routes' limit
        assert control.status_code == 413 and "--max-control-body-bytes" in control.json()["message"], path
    bad_length = c.post("/generate", content=b"{}", headers={"content-length": "abc",
                                                             "content-type": "application/json"})
    assert bad_length.status_code == 400
    assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN}).status_code == 200


@pytest.mark.parametrize("body", [{"input_ids": [[5]] * 200_000}, {"text": ["a"] * 200_000}])
def test_a_batch_over_the_limit_is_refused_before_its_prompts_are_read(client, engine, body):
    """Counted first (2M one-token prompts, 10 MB of JSON, took 38 s to refuse, the event loop
    blocked throughout): the refusal costs the body's parse, not a check of every prompt."""
    start = time.perf_counter()
    resp = client.post("/generate", json={**body, "sampling_params": GEN})
    assert resp.status_code == 400 and "asks for 200000 prompts" in resp.json()["message"], resp.text
    assert time.perf_counter() - start < 5.0
    assert idle(engine)


def test_duplicated_rid_refused_before_anything_runs(client, engine):
    body = {"input_ids": [[5, 6], [7, 8], [9, 10]], "sampling_params": GEN, "rid": ["a", "b", "a"]}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400 and "'a' appears twice" in resp.json()["message"]
    assert idle(engine)
    # nothing was left in flight under those rids
    assert client.post("/generate", json={**body, "rid": ["a", "b", "c"]}).status_code == 200


def _deeply_nested_metadata(depth: int, keep: list) -> str:
    """A bucket payload whose metadata is a list nested `depth` deep (raw pickle opcodes: no
    recursion to build it)."""
    from weight_sync.cuda_ipc import serialize

    tensor = torch.zeros(4, dtype=torch.uint8)
    keep.append(tensor)
    raw = serialize({"flattened_tensor": tensor, "metadata": ["DEEP"]})
    at = raw.index(b"\x8c\x04DEEP")
    raw = raw[:at] + b"]" * depth + b"a" * (depth - 1) + raw[at + 6:]
    return base64.b64encode(raw).decode()


def test_malformed_weight_payloads_are_400(engine):
    from weight_sync.bucket import FlattenedTensorMetadata
    from weight_sync.cuda_ipc import serialize

    keep: list = []  # the sender keeps its shared-memory tensors alive until the reply
    tensor = torch.zeros(4, dtype=torch.uint8)
    keep.append(tensor)
    no_fields = object.__new__(FlattenedTensorMetadata)
    cases = {
        "metadata with no fields": serialize({"flattened_tensor": tensor, "metadata": [no_fields]}, as_text=True),
        "deeply nested metadata": _deeply_nested_metadata(100_000, keep),
        "not base64": "!!!",
        "truncated pickle": serialize([("x", torch.zeros(2))], as_text=True)[:24],
        "empty": "",
    }
    with TestClient(create_app(engine)) as c:
        before = engine.get_weights_checksum()
        for what, payload in cases.items():
            resp = c.post("/update_weights_from_tensor",
                          json={"serialized_named_tensors": [payload], "load_format": "flattened_bucket"})
            assert resp.status_code == 400 and resp.json()["success"] is False, (what, resp.text)
        assert engine.get_weights_checksum() == before
        assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": GEN}).status_code == 200


ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/pause_generation", "/update_weights_from_disk",
          "/update_weights_from_tensor", "/update_weights_from_distributed", "/init_weights_update_group",
          "/update_weight_version", "/abort_request", "/get_weights_by_name", "/start_profile",
          "/destroy_weights_update_group"]
GARBAGE = [b"{not json", b"[]", b'"text"', b"null", b"\xff\xfe\x00", b'{"input_ids": "x", "n": {}}',
           b'{"names": [[[[[]]]]], "prompt": {"a": 1}, "messages": 7, "model_path": []}']


@pytest.mark.parametrize("route", ROUTES)
def test_garbage_bodies_never_500(client, engine, route):
    for body in GARBAGE:
        resp = client.post(route, content=body, headers={"content-type": "application/json"})
        assert resp.status_code < 500, (route, body, resp.status_code, resp.text)
        if body[:1] != b"{":  # not a JSON object: no route takes it
            assert resp.status_code == 400, (route, body, resp.text)
    client.post("/continue_generation")  # unknown fields are ignored: {"n": {}} is a valid pause
    assert client.get("/health").status_code == 200
