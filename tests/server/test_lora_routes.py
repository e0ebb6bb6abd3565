"""SGLang's LoRA routes over HTTP: load / unload / load from tensors with SGLang's replies (400 on
failure), lora_path on /generate (per prompt, None = base), the OpenAI routes' adapter selection
(lora_path, or model "base:adapter"), a hostile pickle in the tensors payload refused unrun, and
every bad request a 400 naming the problem."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import pickle

import pytest
import torch

# peft (the oracle) is imported by the fixtures only: it imports triton, which the Triton
# interpreter tests must find unimported at collection (they set TRITON_INTERPRET first)
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)

from tests.engine.lora_setup import make_peft_adapter  # noqa: E402

ONE = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=3)


@pytest.fixture(scope="module")
def lora_client(engine_factory, adapter_dir):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    eng = engine_factory(lora_paths=[f"a={adapter_dir}"])
    with TestClient(create_app(eng)) as c:
        yield c, eng


def _ids(client, **body):
    r = client.post("/generate", json={"input_ids": IDS, "sampling_params": ONE, **body})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"] if isinstance(r.json(), dict) else [o["output_ids"] for o in r.json()]


def test_generate_lora_path_per_prompt(lora_client):
    client, eng = lora_client
    with_a = eng.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"]
    base = eng.generate(input_ids=IDS, sampling_params=ONE)["output_ids"]
    assert with_a != base
    assert _ids(client, lora_path="a") == with_a
    r = client.post("/generate", json={"input_ids": [IDS, IDS], "sampling_params": ONE, "lora_path": ["a", None]})
    assert [o["output_ids"] for o in r.json()] == [with_a, base]


def test_openai_routes_select_the_adapter(lora_client):
    client, eng = lora_client
    want = eng.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"]
    want_text = eng.tokenizer.decode(want)
    body = {"prompt": IDS, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    for extra in ({"model": "tiny:a"}, {"model": "tiny", "lora_path": "a"}):
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want_text
    r = client.post("/v1/completions", json={**body, "model": "tiny:nope"})
    assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}
    base = client.post("/v1/chat/completions", json={**chat, "model": "tiny"}).json()["choices"][0]
    r = client.post("/v1/chat/completions", json={**chat, "model": "tiny:a"})
    assert r.status_code == 200 and r.json()["choices"][0] != base


def test_server_info_lora_paths_as_sglang_normalises_them(lora_client, adapter_dir, client):
    """SGLang's /server_info serialises ServerArgs after check_lora_server_args turned lora_paths
    into LoRARef records: a list of {"lora_id", "lora_name", "lora_path", "pinned"} with LoRA on
    (0.5.23: lora_id = uuid5(NAMESPACE_URL, name + NUL + path).hex), null with it off; never the
    --lora-paths strings. Miles' {name: path} form and the JSON form become the same records."""
    import uuid

    from engine.config import ServerArgs
    from engine.lora.lora_paths import lora_refs

    def ref(name, path, pinned=False):
        return {"lora_id": uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex, "lora_name": name,
                "lora_path": path, "pinned": pinned}

    lc, _ = lora_client
    for route in ("/server_info", "/get_server_info"):
        assert lc.get(route).json()["lora_paths"] == [ref("a", str(adapter_dir))]
        assert client.get(route).json()["lora_paths"] is None
    miles = ServerArgs(model_path="m", lora_paths={"miles_lora": "/ckpt/lora"}).lora_paths
    assert lora_refs(miles) == [ref("miles_lora", "/ckpt/lora")]
    forms = ["/p/bare", "n=/p/x", '{"lora_name": "j", "lora_path": "/p/j", "pinned": true}']
    assert lora_refs(ServerArgs(model_path="m", lora_paths=forms).lora_paths) == [
        ref("/p/bare", "/p/bare"), ref("n", "/p/x"), ref("j", "/p/j", True)]


def test_bad_lora_requests_are_400s(lora_client, client):
    lc, _ = lora_client
    r = lc.post("/generate", json={"input_ids": IDS, "sampling_params": ONE, "lora_path": "nope"})
    assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.text
    r = lc.post("/generate", json={"input_ids": IDS, "sampling_params": ONE, "lora_path": 3})
    assert r.status_code == 400 and "lora_path must be" in r.text
    # a server without LoRA no longer answers with the base weights
    r = client.post("/generate", json={"input_ids": IDS, "sampling_params": ONE, "lora_path": "a"})
    assert r.status_code == 400 and "--enable-lora" in r.text
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 400 and r.json()["success"] is False and "LoRA is not enabled" in r.json()["error_message"]
    r = lc.post("/load_lora_adapter", json={"lora_name": "z"})
    assert r.status_code == 400 and "lora_path" in r.text


def test_load_unload_and_from_tensors_flattened_bucket(lora_client, adapter_dir):
    from safetensors.torch import load_file

    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    client, eng = lora_client
    want = eng.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"]
    r = client.post("/load_lora_adapter", json={"lora_name": "disk", "lora_path": str(adapter_dir)})
    assert r.status_code == 200 and r.json() == {"success": True, "error_message": None,
                                                 "loaded_adapters": {"a": str(adapter_dir), "disk": str(adapter_dir)}}
    assert _ids(client, lora_path="disk") == want
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    bucket = FlattenedBucket.pack(list(load_file(adapter_dir / "adapter_model.safetensors").items())).to_payload()
    r = client.post("/load_lora_adapter_from_tensors", json={
        "lora_name": "pushed", "config_dict": config, "serialized_tensors": serialize(bucket, as_text=True),
        "load_format": "flattened_bucket"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _ids(client, lora_path="pushed") == want
    for name in ("disk", "pushed"):
        r = client.post("/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200 and name not in r.json()["loaded_adapters"]
    r = client.post("/unload_lora_adapter", json={"lora_name": "pushed"})
    assert r.status_code == 400 and "'pushed' is not loaded" in r.json()["error_message"]


def test_from_tensors_sglang_0518_body_and_upsert(lora_client, adapter_dir):
    """Miles' body (SGLang 0.5.18): serialized_named_tensors, one payload per TP rank, upsert, pinned
    and a null expected_checksums; an upsert of a loaded name replaces it."""
    from safetensors.torch import load_file

    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    client, eng = lora_client
    want = eng.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    bucket = FlattenedBucket.pack(list(load_file(adapter_dir / "adapter_model.safetensors").items())).to_payload()
    payload = serialize(bucket, as_text=True)  # shared memory: the bucket stays alive while it is read
    body = {"lora_name": "miles", "config_dict": config, "serialized_named_tensors": [payload, payload],
            "load_format": "flattened_bucket", "pinned": False, "upsert": True, "expected_checksums": None}
    for _ in range(2):  # the second replaces the first
        r = client.post("/load_lora_adapter_from_tensors", json=body)
        assert r.status_code == 200 and r.json()["success"] and "miles" in r.json()["loaded_adapters"], r.text
        assert _ids(client, lora_path="miles") == want
    again = client.post("/load_lora_adapter_from_tensors", json={**body, "upsert": False})
    assert again.status_code == 400 and "miles" in again.json()["error_message"]
    other = dict(load_file(adapter_dir / "adapter_model.safetensors"))  # other weights: the upsert replaces
    other = {name: t * 3 for name, t in other.items()}
    other_bucket = FlattenedBucket.pack(list(other.items())).to_payload()
    r = client.post("/load_lora_adapter_from_tensors", json={
        **body, "serialized_named_tensors": [serialize(other_bucket, as_text=True)]})
    assert r.status_code == 200 and _ids(client, lora_path="miles") != want, r.text
    failed = client.post("/load_lora_adapter_from_tensors", json={**body, "config_dict": {**config, "r": 0}})
    message = failed.json()["error_message"]
    assert failed.status_code == 400 and "was unloaded" in message and "miles" not in failed.json()["loaded_adapters"]
    import threading

    replies = []
    racers = [threading.Thread(target=lambda: replies.append(client.post("/load_lora_adapter_from_tensors", json=body)))
              for _ in range(3)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(timeout=60)
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]  # one at a time, each replaces
    assert _ids(client, lora_path="miles") == want
    fresh = client.post("/load_lora_adapter_from_tensors", json={**body, "lora_name": "new", "config_dict": {}})
    assert fresh.status_code == 400 and "was unloaded" not in fresh.text  # nothing of that name was there
    for bad, words in (({"serialized_tensors": payload}, "exactly one"), ({"serialized_named_tensors": []}, "non-empty"),
                       ({"upsert": "yes"}, "upsert"),
                       ({"serialized_named_tensors": None}, "exactly one"),
                       ({"expected_checksums": {"x": "abc"}}, "expected_checksums")):
        r = client.post("/load_lora_adapter_from_tensors", json={**body, **bad})
        assert r.status_code == 400 and words in r.text, (bad, r.text)


def test_expected_checksums_are_miles_sha256_of_each_tensor(lora_client, adapter_dir):
    """Miles' --check-weight-update-equal: sha256 of each tensor's bytes as it hashes them; a tensor
    that differs (or is missing) refuses the load, naming it."""
    import hashlib

    from safetensors.torch import load_file

    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    client, _ = lora_client
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    sums = {n: hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}
    bucket = FlattenedBucket.pack(list(tensors.items())).to_payload()
    payload = serialize(bucket, as_text=True)  # shared memory: the bucket stays alive while it is read
    body = {"lora_name": "checked", "config_dict": json.loads((adapter_dir / "adapter_config.json").read_text()),
            "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "expected_checksums": sums}
    ok = client.post("/load_lora_adapter_from_tensors", json=body)
    assert ok.status_code == 200 and ok.json()["success"], ok.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "checked"}).json()["success"]
    name = sorted(sums)[0]
    for bad, words in (({**sums, name: "0" * 64}, f"1 tensors differ from what was sent ({name})"),
                       ({**sums, "nope.weight": "0" * 64}, "expected_checksums: 1 are missing (nope.weight);"),
                       ({name: 5}, "body.expected_checksums")):
        r = client.post("/load_lora_adapter_from_tensors", json={**body, "expected_checksums": bad})
        assert r.status_code == 400 and words in r.text, r.text
        assert "checked" not in ((r.json().get("loaded_adapters") or {}) if "success" in r.json() else {})


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_payload_executes_nothing(lora_client, tmp_path, adapter_dir):
    client, eng = lora_client
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps({"x": _Hostile(str(marker))})).decode()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    for load_format in (None, "flattened_bucket"):
        r = client.post("/load_lora_adapter_from_tensors", json={
            "lora_name": "evil", "config_dict": config, "serialized_tensors": payload, "load_format": load_format})
        message = r.json()["error_message"]
        assert r.status_code == 400 and "payload refused" in message and "system" in message, r.text
    assert not marker.exists()
    assert "evil" not in client.post("/unload_lora_adapter", json={"lora_name": "a_missing"}).json()["loaded_adapters"]
    assert _ids(client, lora_path="a")  # still serving


def test_http_client_lora_verbs(lora_client, adapter_dir, live_server_factory):
    from engine_client.client import HttpClient

    _, eng = lora_client
    http = HttpClient(live_server_factory(eng).url)
    try:
        want = eng.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"]
        assert http.generate(input_ids=IDS, sampling_params=ONE, lora_path="a")["output_ids"] == want
        assert http.load_lora_adapter("c", adapter_dir)["success"]
        bad = http.load_lora_adapter("c", adapter_dir)
        assert bad["success"] is False and "already loaded" in bad["error_message"]
        assert http.generate(input_ids=IDS, sampling_params=ONE, lora_path="c")["output_ids"] == want
        assert "c" not in http.unload_lora_adapter("c")["loaded_adapters"]
        from safetensors.torch import load_file

        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        tensors = load_file(adapter_dir / "adapter_model.safetensors")  # serialized by the client (shared memory)
        assert http.load_lora_adapter_from_tensors("d", tensors, config)["success"]
        assert http.generate(input_ids=IDS, sampling_params=ONE, lora_path="d")["output_ids"] == want
        assert http.unload_lora_adapter("d")["success"]
        with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
            http.generate(input_ids=IDS, sampling_params=ONE, lora_path="c")
    finally:
        http.close()
