"""GroupSender's pipeline, against a recording group and engines (no process group needed): one
broadcast per bucket to every engine, the next bucket packed while the last is on the wire, at most
two packed buckets alive, refusals and a broken group raised as WeightSyncError."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from weight_sync import nccl
from weight_sync.base import WeightSyncError
from weight_sync.bucket import FlattenedBucket
from weight_sync.nccl import GroupSender
from weight_sync.weight_group import GroupBroken


class _Work:
    def __init__(self, buffer: torch.Tensor) -> None:
        self.size = buffer.numel()  # not the buffer: the sender alone keeps it alive


class _Group:
    """Records every start and wait; `fail_at` makes that broadcast's wait fail (a dead engine)."""

    def __init__(self, events: list, fail_at: int = -1) -> None:
        self.events, self.fail_at, self.buffers = events, fail_at, []

    def start_broadcast(self, tensor, src=0):
        assert src == 0 and tensor.dtype == torch.uint8
        self.buffers.append(weakref.ref(tensor))
        gc.collect()
        self.events.append(("broadcast", len(self.buffers) - 1, sum(r() is not None for r in self.buffers)))
        return _Work(tensor)

    def wait(self, work):
        index = sum(1 for e in self.events if e[0] == "wait")
        self.events.append(("wait", index))
        if index == self.fail_at:
            raise GroupBroken("broadcast in group 'g' failed within 30 s: Connection reset by peer")


class _Engine:
    def __init__(self, events: list, name: str, refuse: str = "") -> None:
        self.events, self.name, self.refuse, self.calls = events, name, refuse, []
        self.lock = threading.Lock()

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache, weight_version,
                                        load_format):
        with self.lock:
            self.calls.append((names, dtypes, shapes, group_name, flush_cache, weight_version, load_format))
        if self.refuse and self.refuse in names:
            return False, f"unknown weight {self.refuse!r}"
        return True, "Success."


def _buckets(k: int) -> list[list]:
    return [[(f"b{i}.w", torch.full((2, 3), float(i))), (f"b{i}.h", torch.ones(4, dtype=torch.bfloat16))]
            for i in range(k)]


def test_one_broadcast_per_bucket_to_every_engine_packed_ahead(monkeypatch):
    events: list = []
    group, engines = _Group(events), [_Engine(events, "e1"), _Engine(events, "e2")]
    real_pack = FlattenedBucket.pack

    def pack(cls, bucket):  # records how many packed buffers are alive besides the one it makes
        gc.collect()
        events.append(("pack", bucket[0][0], sum(r() is not None for r in group.buffers)))
        return real_pack(bucket)

    monkeypatch.setattr(nccl.FlattenedBucket, "pack", classmethod(pack))
    sender = GroupSender(group, "g")
    buckets = _buckets(4)
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        sender.send_all(engines, bucket, flush_cache=last, weight_version="v1" if last else None)
    # bucket k+1 is packed before bucket k's broadcast is waited for; the last is waited before returning
    assert [e[:2] for e in events] == [
        ("pack", "b0.w"), ("broadcast", 0),
        ("pack", "b1.w"), ("wait", 0), ("broadcast", 1),
        ("pack", "b2.w"), ("wait", 1), ("broadcast", 2),
        ("pack", "b3.w"), ("wait", 2), ("broadcast", 3), ("wait", 3)]
    assert max(e[2] for e in events if e[0] == "pack") == 1  # the one on the wire: two alive at most
    assert max(e[2] for e in events if e[0] == "broadcast") == 1  # the last one freed before the next goes
    for engine in engines:  # SGLang's request shape, one call per bucket; the last flushes and versions
        assert [c[0] for c in engine.calls] == [[n for n, _ in b] for b in buckets]
        assert all(c[1] == ["float32", "bfloat16"] and c[2] == [[2, 3], [4]] and c[3] == "g" for c in engine.calls)
        assert [(c[4], c[5], c[6]) for c in engine.calls] == [(False, None, "flattened_bucket")] * 3 + \
            [(True, "v1", "flattened_bucket")]


def test_the_packed_buffer_is_sglangs_flattened_layout():
    captured = []

    class Capture(_Group):
        def start_broadcast(self, tensor, src=0):
            captured.append(tensor.clone())
            return _Work(tensor)

    bucket = _buckets(1)[0]
    GroupSender(Capture([]), "g").send_all([_Engine([], "e")], bucket, True, "v")
    raw = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for _, t in bucket)
    assert captured[0].numpy().tobytes() == raw  # bytes back to back, in names order, no padding


def test_a_refusal_or_a_broken_group_raises():
    engines = [_Engine([], "e1"), _Engine([], "e2", refuse="b1.w")]
    sender = GroupSender(_Group([]), "g")
    sender.send_all(engines, _buckets(2)[0], False, None)
    sender.send_all(engines, _buckets(2)[1], False, None)  # refused, found when the next bucket goes
    with pytest.raises(WeightSyncError, match="engine refused the weights: unknown weight 'b1.w'"):
        sender.send_all(engines, _buckets(3)[2], True, "v")
    sender = GroupSender(_Group([], fail_at=0), "g")
    with pytest.raises(WeightSyncError, match="Connection reset by peer.*the engines answered"):
        sender.send_all(engines[:1], _buckets(1)[0], True, "v")
    assert sender.send(_Engine([], "e3"), _buckets(1)[0], True, "v") == (True, "Success.")

    class Broken(_Group):
        def start_broadcast(self, tensor, src=0):
            raise GroupBroken("group 'g' failed earlier (Connection reset by peer); destroy it and form it again")

    idle = _Engine([], "e4")
    with pytest.raises(WeightSyncError, match="failed earlier"):
        GroupSender(Broken([]), "g").send_all([idle], _buckets(1)[0], True, "v")
    assert idle.calls == []  # no engine left waiting for a broadcast that cannot come


def test_a_push_that_fails_mid_update_waits_for_its_bucket_on_the_wire_before_continuing():
    """The trainer's runs fail after one bucket went out (a ZeRO-3 gather raising): that bucket's
    broadcast and every engine's receive call end before the engines continue generating (they
    would otherwise resume on half-updated weights while the receive is still to come), and the
    trainer's error is the one raised."""
    from trainer_bridge.sync import push_to_engines

    events: list = []

    class Slow(_Engine):
        def update_weights_from_distributed(self, *args, **kwargs):
            time.sleep(0.3)  # the receive call runs late (an HTTP round trip)
            answer = super().update_weights_from_distributed(*args, **kwargs)
            self.events.append(("received", self.name))
            return answer

        def pause_generation(self, mode):
            self.events.append(("pause", self.name))

        def continue_generation(self):
            self.events.append(("continue", self.name))

    engines = [Slow(events, "e1"), Slow(events, "e2")]

    def runs():
        yield _buckets(1)[0]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        push_to_engines(engines, runs(), "v1", transport="distributed", group=_Group(events), group_name="g")
    order = [e for e in events if e[0] in ("received", "continue", "wait")]
    assert order.index(("wait", 0)) < order.index(("continue", "e1"))
    for name in ("e1", "e2"):
        assert order.index(("received", name)) < min(order.index(("continue", n)) for n in ("e1", "e2"))


def test_an_engine_that_never_answers_fails_the_update_within_the_groups_timeout():
    """The broadcast went through but an engine's receive call never returns (a wedged engine, a
    client without a timeout): the update fails naming it, within the group's timeout, not a hang."""
    import datetime

    release = threading.Event()

    class Wedged(_Engine):
        def update_weights_from_distributed(self, *args, **kwargs):
            release.wait(30)
            return True, "Success."

    group = _Group([])
    group.timeout = datetime.timedelta(seconds=0.3)
    sender = GroupSender(group, "g")
    start = time.perf_counter()
    try:
        with pytest.raises(WeightSyncError, match="did not answer its receive call within 0.3 s"):
            sender.send_all([_Engine([], "ok"), Wedged([], "stuck")], _buckets(1)[0], True, "v")
        assert time.perf_counter() - start < 5
    finally:
        release.set()
        sender.close()
