"""Request bodies the RL frameworks send that tandem lacked (issue 26, item 4): verl's
LocalSerializedTensor weight sync under both SGLang class paths, /tokenize and /detokenize, ROLL's
GET /get_load, SGLang's disk-update message and the chat metadata option."""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import sys
import time
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from fastapi.testclient import TestClient

from engine.server.http import create_app

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
CLASS_MODULES = ("sglang.srt.model_executor.model_runner",
                 "sglang.srt.model_executor.model_runner_components.weight_updater")


@pytest.fixture(params=CLASS_MODULES, ids=["model_runner", "weight_updater"])
def local_serialized_tensor(request, monkeypatch):
    """A class named exactly as SGLang's LocalSerializedTensor (a dataclass of `values`), in a
    module registered under that SGLang path, so pickle writes SGLang's bytes."""
    module_name = request.param

    @dataclasses.dataclass
    class LocalSerializedTensor:
        values: list

    LocalSerializedTensor.__module__ = module_name
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(module_name)
    module.LocalSerializedTensor = LocalSerializedTensor
    monkeypatch.setitem(sys.modules, module_name, module)
    return LocalSerializedTensor


def mp_serialize(obj) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize: ForkingPickler with torch's reductions (a CPU
    tensor goes by file descriptor, torch's default sharing strategy)."""
    import torch.multiprocessing  # noqa: F401

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def verl_named_tensors(cls, named, tp_size=2) -> list:
    """sglang.srt.weight_sync.utils.update_weights on the trainer's TP rank 0: each rank's
    serialized tensors, transposed into one LocalSerializedTensor per name."""
    per_rank = [[(name, mp_serialize(t)) for name, t in named] for _ in range(tp_size)]
    return [(group[0][0], cls(values=[part[1] for part in group])) for group in zip(*per_rank, strict=True)]


def verl_payloads(cls, named, tp_size=2) -> list[str]:
    """serialized_named_tensors as verl's HTTP adapter posts them: one base64 payload per rank."""
    payload = verl_named_tensors(cls, named, tp_size)
    return [base64.b64encode(mp_serialize(payload)).decode() for _ in range(tp_size)]


def _new_norm(eng, scale: float) -> list:
    old = torch.tensor(eng.get_weights_by_name("model.norm.weight"))
    return [("model.norm.weight", old * 0 + scale)]


def test_verl_local_serialized_tensor_over_http(engine_factory, local_serialized_tensor):
    eng = engine_factory()
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    with TestClient(create_app(eng)) as c:
        before = c.post("/generate", json=body).json()["output_ids"]
        named = _new_norm(eng, 0.25)
        resp = c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": verl_payloads(local_serialized_tensor, named), "load_format": None,
            "flush_cache": True, "weight_version": "verl-1"})
        assert resp.status_code == 200 and resp.json()["success"], resp.json()
        assert eng.get_weights_by_name("model.norm.weight") == pytest.approx([0.25] * len(named[0][1]))
        after = c.post("/generate", json=body).json()
        assert after["meta_info"]["weight_version"] == "verl-1" and after["output_ids"] != before


def test_verl_local_serialized_tensor_through_the_engine_api(engine_factory, local_serialized_tensor):
    eng = engine_factory()
    named = _new_norm(eng, 0.5)
    ok, message = eng.update_weights_from_tensor(verl_named_tensors(local_serialized_tensor, named))
    assert ok, message
    assert eng.get_weights_by_name("model.norm.weight") == pytest.approx([0.5] * len(named[0][1]))
    payload = mp_serialize(verl_named_tensors(local_serialized_tensor, _new_norm(eng, 0.75)))
    ok, message = eng.update_weights_from_tensor(payload, weight_version="verl-2")  # SGLang's bytes as they are
    assert ok, message
    assert eng.get_weights_by_name("model.norm.weight")[0] == pytest.approx(0.75)
    assert eng.get_weight_version() == "verl-2"


def test_verl_sync_reaches_every_tensor_parallel_rank(engine_factory, local_serialized_tensor):
    """tandem's rank 0 reads values[0] and sends the tensor on: both ranks' outputs change alike."""
    eng, one_rank = engine_factory(tp_size=2), engine_factory()  # one rank: the reference
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    before = eng.generate(**body)["output_ids"]
    named = _new_norm(one_rank, 0.25)
    ok, message = eng.update_weights_from_tensor(mp_serialize(verl_named_tensors(local_serialized_tensor, named)))
    assert ok, message
    assert one_rank.update_weights_from_tensor(verl_named_tensors(local_serialized_tensor, named))[0]
    assert eng.generate(**body)["output_ids"] == one_rank.generate(**body)["output_ids"] != before


class _Exploit:
    path = ""  # the file unpickling it would create: the test's own

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_hostile_nested_value_executes_nothing(engine_factory, local_serialized_tensor, tmp_path):
    import os

    eng = engine_factory()
    marker = _Exploit.path = str(tmp_path / "pwned-by-nested-value")
    before = eng.get_weights_by_name("model.norm.weight")
    lst = local_serialized_tensor
    cases = [
        (lst(values=[pickle.dumps(_Exploit())]), "names io.open"),
        (lst(values=[mp_serialize(lst(values=[b"x"]))]), "a LocalSerializedTensor's value may hold only a tensor"),
        (lst(values=[mp_serialize([1, 2])]), "holds a list, not a tensor"),
        (lst(values=[]), "values must be a non-empty list of bytes"),
        (lst(values=[1, 2]), "values must be a non-empty list of bytes"),
    ]
    with TestClient(create_app(eng)) as c:
        for value, reason in cases:
            payload = base64.b64encode(mp_serialize([("model.norm.weight", value)])).decode()
            resp = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
            assert resp.status_code == 400 and reason in resp.json()["message"], resp.json()
        assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": GREEDY}).status_code == 200
    assert not os.path.exists(marker)
    assert eng.get_weights_by_name("model.norm.weight") == before


def test_tokenize_detokenize_round_trip(engine_factory):
    eng = engine_factory()
    text = "hello world, the engine"
    with TestClient(create_app(eng)) as c:
        for prefix in ("", "/v1"):
            one = c.post(f"{prefix}/tokenize", json={"model": "m", "prompt": text, "add_special_tokens": False})
            assert one.status_code == 200
            reply = one.json()
            assert reply["tokens"] == eng.tokenizer.encode(text, add_special_tokens=False)
            assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == eng.info.context_len
            back = c.post(f"{prefix}/detokenize", json={"tokens": reply["tokens"]}).json()
            assert back == {"text": eng.tokenizer.decode(reply["tokens"], skip_special_tokens=True)}
            assert text in back["text"] or back["text"].strip() == text.strip()
            many = c.post(f"{prefix}/tokenize", json={"prompt": [text, "a"]}).json()
            assert many["count"] == [len(ids) for ids in many["tokens"]] and len(many["tokens"]) == 2
            texts = c.post(f"{prefix}/detokenize", json={"tokens": many["tokens"]}).json()["text"]
            assert isinstance(texts, list) and len(texts) == 2
        assert c.post("/detokenize", json={"tokens": []}).json() == {"text": ""}
        bad = c.post("/detokenize", json={"tokens": [10 ** 9]})
        assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["message"]
        assert c.post("/tokenize", json={"prompt": 3}).status_code == 400


def test_tokenize_chat_messages_as_the_chat_route_renders_them(engine_factory):
    """SGLang's newer /tokenize (vLLM's chat form): messages through the chat template; the count
    equals the chat route's prompt_tokens for the same messages."""
    from engine.tokenizer import apply_chat_template

    eng = engine_factory()
    chat = [{"role": "system", "content": "be brief"}, {"role": "User", "content": "hi"}]
    seen = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with TestClient(create_app(eng)) as c:
        reply = c.post("/v1/tokenize", json={"model": "m", "messages": chat}).json()
        assert reply["tokens"] == apply_chat_template(eng.tokenizer, seen) and reply["count"] == len(reply["tokens"])
        used = c.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1}).json()["usage"]
        assert used["prompt_tokens"] == reply["count"]
        bare = c.post("/tokenize", json={"messages": chat, "add_generation_prompt": False}).json()["tokens"]
        assert bare == apply_chat_template(eng.tokenizer, seen, add_generation_prompt=False) != reply["tokens"]
        cont = c.post("/tokenize", json={"messages": chat + [{"role": "assistant", "content": "Sure"}],
                                         "continue_final_message": True, "add_generation_prompt": False}).json()
        assert cont["tokens"] == apply_chat_template(eng.tokenizer, seen, assistant_prefix="Sure")
        for body in ({"prompt": "x", "messages": chat}, {}, {"messages": [{"role": "robot", "content": "x"}]}):
            resp = c.post("/tokenize", json=body)
            assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["message"].startswith("body.messages.0.role: ")  # named as the chat route names it


def test_get_load_as_roll_reads_it(engine_factory):
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        idle = c.get("/get_load").json()
        assert isinstance(idle, list) and len(idle) == 1
        assert idle[0]["num_reqs"] == 0 and idle[0]["num_waiting_reqs"] == 0 and idle[0]["dp_rank"] == 0
        eng.pause_generation(mode="retract")  # requests sent now wait in the queue
        try:
            stream = _submit_waiting(eng, 3)
            load = c.get("/get_load").json()[0]
            assert load["num_reqs"] == 3 and load["num_waiting_reqs"] == 3
        finally:
            eng.continue_generation()
        stream.result(timeout=60)
        assert c.get("/get_load").json()[0]["num_reqs"] == 0
        eng.client.send(lambda core: time.sleep(3))  # the core is busy for 3 s (a white-box stall)
        time.sleep(0.1)
        t0 = time.monotonic()
        busy = c.get("/get_load").json()[0]
        assert time.monotonic() - t0 < 1.0 and busy["num_reqs"] == 0 and busy["num_waiting_reqs"] == 0


def _submit_waiting(eng, n: int):
    import asyncio
    import threading
    from concurrent.futures import Future

    done: Future = Future()
    loop = asyncio.new_event_loop()
    submitted = threading.Event()

    async def run():
        stream = eng.async_generate(input_ids=[[5, 6, 7]] * n, sampling_params=GREEDY)
        submitted.set()
        return await stream

    threading.Thread(target=lambda: done.set_result(loop.run_until_complete(run())), daemon=True).start()
    assert submitted.wait(10)
    return done


def test_disk_update_answers_sglang_text(engine_factory, tiny_model_dir):
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        resp = c.post("/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "d1"})
        assert resp.status_code == 200
        assert resp.json()["message"] == "Succeeded to update model weights." and resp.json()["success"]
        assert c.get("/model_info").json()["weight_version"] == "d1"


@pytest.mark.parametrize("metadata_format", ["spans", "weight_version"])
def test_chat_metadata_formats(engine_factory, metadata_format):
    eng = engine_factory(chat_metadata_format=metadata_format)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(eng)) as c:
        reply = c.post("/v1/chat/completions", json=body).json()
    metadata = reply["metadata"]
    if metadata_format == "spans":  # SGLang 0.5.23, the default
        assert metadata["weight_version"] == "default"
        assert metadata["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
        return
    assert metadata == {"weight_version": "default"}
    try:
        from openai.types.chat import ChatCompletion
    except ImportError:  # the package is optional: its Dict[str, str] is what it would check
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        return
    assert ChatCompletion.model_validate(reply).metadata == {"weight_version": "default"}
