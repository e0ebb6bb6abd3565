"""Atomic weight updates (issue 14, item 3): every check that can fail runs before the first
write, so a refused update leaves every parameter bit-identical; a write that fails anyway says
the weights may be partly written; an update under an `in_place` pause refuses or succeeds, and
its reply, the weights and weight_version always agree.

Oracle: a copy of every parameter taken before the update, compared with torch.equal.
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time

import pytest
import torch

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
BAD = "model.norm.weight"  # sorts last: it lands in the second shard


@pytest.fixture(scope="module")
def eng(engine_factory):
    return engine_factory()


@pytest.fixture(scope="module")
def new_tensors(other_model_dir) -> dict:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return {n: t for path in safetensors_files(other_model_dir) for n, t in load_file(path).items()}


def _snapshot(eng) -> dict:
    return {n: p.detach().clone() for n, p in eng.local_core.runner.model.named_parameters()}


def _assert_unchanged(eng, before: dict, paused: bool = False) -> None:
    now = dict(eng.local_core.runner.model.named_parameters())
    changed = [n for n, p in before.items() if not torch.equal(p, now[n])]
    assert not changed, f"written although refused: {changed[:5]}"
    assert eng.get_weight_version() == "default" and eng.local_core.paused == paused
    eng.check_integrity()


def _write_safetensors(path, entries: dict) -> None:
    """name -> (safetensors dtype, shape, raw bytes): writes dtypes the library cannot (F4, F6)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(d for _, _, d in entries.values()))


def _two_shards(tmp_path, other_model_dir, tensors: dict, bad_dtype: str, bad_data: bytes) -> str:
    """The new checkpoint in two shards; the second holds BAD stored as `bad_dtype`."""
    from safetensors.torch import save_file

    out = tmp_path / f"shards-{bad_dtype}"
    shutil.copytree(other_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    assert BAD in second
    save_file({n: tensors[n] for n in first}, str(out / "model-1.safetensors"))
    entries = {n: ("F32", tensors[n].shape, tensors[n].float().numpy().tobytes()) for n in second if n != BAD}
    entries[BAD] = (bad_dtype, tensors[BAD].shape, bad_data)
    _write_safetensors(out / "model-2.safetensors", entries)
    index = {"weight_map": {n: "model-1.safetensors" for n in first} | {n: "model-2.safetensors" for n in second}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(out)


def _restore(eng) -> None:
    ok, message, _ = eng.update_weights_from_disk(eng.server_args.model_path, weight_version="default")
    assert ok, message


@pytest.mark.parametrize("bad_dtype,bits", [("F6_E2M3", 6), ("F6_E3M2", 6), ("F4", 4)])
def test_a_bad_dtype_in_the_second_shard_writes_nothing(eng, other_model_dir, new_tensors, tmp_path,
                                                        bad_dtype, bits):
    data = bytes(new_tensors[BAD].numel() * bits // 8)
    path = _two_shards(tmp_path, other_model_dir, new_tensors, bad_dtype, data)
    before = _snapshot(eng)
    ok, message, _ = eng.update_weights_from_disk(path, weight_version="bad")
    assert not ok and message.startswith("Weights not updated"), message
    assert f"weight '{BAD}'" in message and f"has dtype {bad_dtype}, which the loader cannot read" in message
    _assert_unchanged(eng, before)


@pytest.mark.parametrize("index,message", [
    (b"{not json", "is not a safetensors index: JSONDecodeError"),
    (b'{"weight_map": "\xc3\x28"}', "is not a safetensors index: UnicodeDecodeError"),
    (b"[1, 2]", 'it needs a non-empty "weight_map" object'),
    (b'{"weight_map": ["model-1.safetensors"]}', 'it needs a non-empty "weight_map" object'),
    (b'{"weight_map": {"x": ["model-1.safetensors"]}}', "weight_map values must be shard file names"),
    (b'{"weight_map": {"x": "../model-1.safetensors"}}', "got '../model-1.safetensors'"),
    (b'{"weight_map": {"x": "/etc/passwd"}}', "got '/etc/passwd'"),
    (b"[" * 100000 + b"]" * 100000, "is not a safetensors index: RecursionError"),
])
def test_a_malformed_index_is_refused_before_any_write(eng, other_model_dir, new_tensors, tmp_path, index, message):
    """Issue 27 item 11: the index was read after the checks' guard, so a KeyError or TypeError
    answered 'weights may be partly written' although nothing was."""
    path = _two_shards(tmp_path, other_model_dir, new_tensors, "F32", new_tensors[BAD].float().numpy().tobytes())
    (tmp_path / "shards-F32" / "model.safetensors.index.json").write_bytes(index)
    before = _snapshot(eng)
    ok, reply, _ = eng.update_weights_from_disk(path, weight_version="bad")
    assert not ok and reply.startswith("Weights not updated: ") and "partly" not in reply, reply
    assert message in reply
    _assert_unchanged(eng, before)


def test_a_castable_float8_shard_loads(eng, other_model_dir, new_tensors, tmp_path):
    """F8_E5M2 copies into float32 parameters, so the same layout succeeds: the check is exact,
    not a blanket refusal of float8."""
    f8 = new_tensors[BAD].to(torch.float8_e5m2)
    path = _two_shards(tmp_path, other_model_dir, new_tensors, "F8_E5M2", f8.view(torch.uint8).numpy().tobytes())
    ok, message, _ = eng.update_weights_from_disk(path, weight_version="f8")
    try:
        assert ok, message
        assert torch.equal(dict(eng.local_core.runner.model.named_parameters())[BAD], f8.float())
        assert eng.get_weight_version() == "f8"
    finally:
        _restore(eng)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_a_tensor_payload_with_a_float4_tensor_second_writes_nothing(eng, new_tensors):
    names = sorted(new_tensors)
    valid = (names[0], new_tensors[names[0]])
    exotic = (BAD, torch.empty(new_tensors[BAD].shape, dtype=torch.float4_e2m1fn_x2))
    before = _snapshot(eng)
    ok, message = eng.update_weights_from_tensor([valid, exotic], weight_version="bad")
    assert not ok and message.startswith("Weights not updated"), message
    assert f"weight '{BAD}' has dtype float4_e2m1fn_x2, which cannot be cast to the parameter's float32" in message
    _assert_unchanged(eng, before)


def test_a_broadcast_with_an_uncastable_tensor_writes_nothing(eng, new_tensors):
    """GroupSource receives every tensor, then the model checks them all before writing."""
    class LoopbackGroup:  # stands in for the trainer's broadcasts: the new weights, in order
        def __init__(self, tensors):
            self.tensors = list(tensors)

        def start_broadcast(self, tensor, src=0):  # WeightGroup's interface: start, then wait
            sent = self.tensors.pop(0)
            if sent.dtype == tensor.dtype and sent.dtype != getattr(torch, "float4_e2m1fn_x2", None):
                tensor.copy_(sent)
            return tensor

        def wait(self, work):
            pass

        def broadcast(self, tensor, src=0):
            self.wait(self.start_broadcast(tensor, src))
            return tensor

    names = sorted(new_tensors)[:3]
    exotic = getattr(torch, "float4_e2m1fn_x2", None)
    if exotic is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    sent = [new_tensors[n] for n in names] + [torch.empty(new_tensors[BAD].shape, dtype=exotic)]
    eng.local_core.control.groups.formed["loopback"] = LoopbackGroup(sent)
    before = _snapshot(eng)
    try:
        ok, message = eng.update_weights_from_distributed(
            names + [BAD], [str(t.dtype) for t in sent], [list(t.shape) for t in sent], "loopback",
            weight_version="bad")
    finally:
        eng.local_core.control.groups.formed.pop("loopback")
    assert not ok and message.startswith("Weights not updated") and "float4_e2m1fn_x2" in message, message
    _assert_unchanged(eng, before)


def test_a_write_that_fails_after_the_checks_says_so(eng, new_tensors, monkeypatch):
    """If a copy still fails (here: the cast check is switched off, so float4 reaches copy_), the
    reply says the weights may be partly written, never 'not updated'."""
    from engine.models.weight_cast import CastCheck

    exotic = getattr(torch, "float4_e2m1fn_x2", None)
    if exotic is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    monkeypatch.setattr(CastCheck, "check", lambda self, name, source, param: None)
    name = sorted(new_tensors)[0]
    ok, message = eng.update_weights_from_tensor(
        [(name, new_tensors[name]), (BAD, torch.empty(new_tensors[BAD].shape, dtype=exotic))])
    assert not ok and message.startswith("Weight update failed (weights may be partly written"), message
    assert "after 1 of 2 tensors were written" in message
    monkeypatch.undo()
    _restore(eng)


def _generate_in_background(eng, prompt, params) -> tuple[threading.Thread, list]:
    result: list = []
    worker = threading.Thread(target=lambda: result.append(eng.generate(input_ids=prompt, sampling_params=params)))
    worker.start()
    deadline = time.monotonic() + 30
    while not eng.local_core.scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return worker, result


def test_an_in_place_update_refuses_before_writing_or_succeeds(eng, new_tensors, other_model_dir):
    long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    worker, result = _generate_in_background(eng, [5, 6, 7, 8], long)
    eng.pause_generation("in_place")
    try:
        before = _snapshot(eng)
        ok, message = eng.update_weights_from_tensor(list(new_tensors.items()), weight_version="v-in-place")
        assert not ok and message.startswith("Weights not updated: flush_cache=True, but 1 request(s)"), message
        assert "flush_cache=False" in message and "retract" in message
        _assert_unchanged(eng, before, paused=True)
        ok, message = eng.update_weights_from_tensor(list(new_tensors.items()), flush_cache=False,
                                                     weight_version="v-in-place")
        assert ok, message
        model = dict(eng.local_core.runner.model.named_parameters())
        assert torch.equal(model[BAD], new_tensors[BAD]) and eng.get_weight_version() == "v-in-place"
    finally:
        eng.continue_generation()
    worker.join(timeout=60)
    assert len(result[0]["output_ids"]) == 400
    assert {s["version"] for s in result[0]["meta_info"]["weight_versions"]} == {"default", "v-in-place"}
    _restore(eng)
    eng.check_integrity()
