"""WeightSender registry: push_weights finds every transport by name; a new one is one subclass."""

from typing import ClassVar

import pytest
import torch

from weight_sync import base
from weight_sync.base import SENDERS, WeightSender, sender_for, transports
from weight_sync.bucket import FlattenedBucket
from weight_sync.tensor import TensorSender
from weight_sync.disk import DiskSender
from weight_sync.nccl import GroupSender


class _Recorder:
    """Stands in for an Engine: records what each transport hands it."""

    def __init__(self):
        self.calls = []

    def update_weights_from_tensor(self, payload, load_format, flush_cache, weight_version):
        bucket = FlattenedBucket(payload["flattened_tensor"], payload["metadata"])
        self.calls.append(("tensor", bucket.unpack(), load_format, flush_cache, weight_version))
        return True, "ok"

    def update_weights_from_disk(self, path, weight_version, flush_cache):
        from safetensors.torch import load_file

        self.calls.append(("disk", sorted(load_file(f"{path}/model.safetensors").items()), flush_cache, weight_version))
        return True, "ok", 0  # sglang.Engine's (success, message, num_paused_requests)


def test_every_transport_is_registered_by_name():
    assert set(transports()) >= {"tensor", "disk", "distributed"}
    assert isinstance(sender_for("tensor"), TensorSender) and isinstance(sender_for("disk"), DiskSender)
    with pytest.raises(ValueError, match="transport must be one of .*got 'carrier-pigeon'"):
        sender_for("carrier-pigeon")
    with pytest.raises(ValueError, match="transport 'distributed' needs group"):
        sender_for("distributed")
    group = object()
    sender = sender_for("distributed", group=group, group_name="g")
    assert isinstance(sender, GroupSender) and (sender.group, sender.group_name) == (group, "g")


def test_tensor_and_disk_senders_hand_over_the_same_tensors():
    bucket = [("a.weight", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    engine = _Recorder()
    assert TensorSender().send(engine, bucket, True, "v1") == (True, "ok")
    assert DiskSender().send(engine, bucket, False, "v2") == (True, "ok")
    (_, unpacked, fmt, flush, version), (_, loaded, disk_flush, disk_version) = engine.calls
    assert (fmt, flush, version, disk_flush, disk_version) == ("flattened_bucket", True, "v1", False, "v2")
    for got in (unpacked, loaded):
        assert [n for n, _ in got] == ["a.weight", "b"]
        assert all(torch.equal(t, ref) and t.dtype == ref.dtype for (_, t), (_, ref) in zip(got, bucket))
    assert not DiskSender.bucketed and TensorSender.bucketed


def test_a_new_transport_is_one_subclass(monkeypatch):
    monkeypatch.setattr(base, "SENDERS", dict(SENDERS))  # registered into a copy, dropped after the test

    class Echo(WeightSender):
        kind: ClassVar[str] = "echo"

        def send(self, engine, bucket, flush_cache, weight_version):
            return True, f"{len(bucket)} tensors"

    assert "echo" in base.SENDERS and "echo" not in SENDERS
    assert sender_for("echo").send(None, [1, 2], True, None) == (True, "2 tensors")
