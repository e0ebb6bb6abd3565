"""weight_sync.cuda_ipc on the CPU: tensors by shared memory, and the allowlist unpickler."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from weight_sync.bucket import FlattenedBucket
from weight_sync.cuda_ipc import RefusedPayload, deserialize, serialize


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(4, 3, generator=g)),
            ("model.norm.weight", torch.randn(3, generator=g).bfloat16()),
            ("empty", torch.zeros(0)), ("strided", torch.randn(3, 3, generator=g)[:, 1])]


@pytest.mark.parametrize("as_text", [False, True], ids=["bytes", "base64"])
def test_named_tensors_and_buckets_round_trip(as_text):
    named = _named()
    back = deserialize(serialize(named, as_text=as_text))
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    bucket = FlattenedBucket.pack(named)
    payload = deserialize(serialize(bucket.to_payload(), as_text=as_text))
    unpacked = FlattenedBucket.from_payload(payload).unpack()
    assert len(unpacked) == len(named)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, unpacked))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("payload,named", [
    (pickle.dumps(_Exploit()), "posix.system"),
    (pickle.dumps(eval), "builtins.eval"),
    (pickle.dumps(torch.hub.load), "torch.hub.load"),
    (pickle.dumps([("w", torch.ones(2))]), "torch._utils._rebuild_tensor_v2"),  # torch.save-style
])
def test_anything_but_tensor_reductions_is_refused_by_name(payload, named):
    with pytest.raises(RefusedPayload, match=f"names {named}"):
        deserialize(payload)


def test_corrupt_payloads_are_named():
    data = serialize(_named())
    with pytest.raises(RefusedPayload, match="could not be read"):
        deserialize(data[: len(data) // 2])
    with pytest.raises(RefusedPayload, match="not base64"):
        deserialize("not base64 !!")


class _Call:
    """Pickles as f(*args): how a hostile payload chains allowed globals."""

    def __init__(self, f, *args):
        self.f, self.args = f, args

    def __reduce__(self):
        return (self.f, self.args)


def test_allowed_globals_cannot_be_chained_into_an_attack(tmp_path):
    from multiprocessing.resource_sharer import DupFd

    import torch.multiprocessing.reductions as R

    victim = open(tmp_path / "victim", "w")  # noqa: SIM115
    fd = victim.fileno()
    raw = _Call(torch.storage.UntypedStorage, list(fd.to_bytes(8, "little")))  # a tensor posing as an fd
    fake_fd = _Call(R.rebuild_tensor, torch.Tensor, _Call(R.rebuild_typed_storage, raw, torch.int64),
                    (0, (), (), False))
    with pytest.raises(RefusedPayload):
        deserialize(pickle.dumps([("w", _Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, fake_fd, 0))]))
    os.fstat(fd)  # still open
    victim.close()
    remote = DupFd.__new__(DupFd)
    remote._id = (("127.0.0.1", 9), 1)  # would make the server connect out
    with pytest.raises(RefusedPayload, match="not a local multiprocessing listener"):
        deserialize(pickle.dumps(_Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, remote, 4)))
    # BUILD aimed at an allowed class: it reaches only this payload's stand-in
    patch = (b"\x80\x04ctorch.storage\nUntypedStorage\nN}X\x12\x00\x00\x00_new_shared_fd_cpuNs\x86b"
             b"cweight_sync.bucket\nFlattenedTensorMetadata\nN}X\x08\x00\x00\x00__init__Ns\x86b\x86.")
    deserialize(patch)
    assert torch.storage.UntypedStorage._new_shared_fd_cpu is not None
    back = deserialize(serialize(_named()))  # later payloads still load
    assert torch.equal(back[0][1], _named()[0][1])


def test_parameters_travel_as_plain_tensors():
    params = list(torch.nn.Linear(3, 2).named_parameters())
    back = deserialize(serialize(params))
    assert [n for n, _ in back] == ["weight", "bias"]
    assert all(type(t) is torch.Tensor and torch.equal(t, p.detach()) for (_, t), (_, p) in zip(back, params))


def test_a_payload_cannot_create_descriptors_or_reach_past_storage(tmp_path):
    from multiprocessing.resource_sharer import DupFd

    import torch.multiprocessing.reductions as R

    secret = open(tmp_path / "secret", "w+")  # noqa: SIM115
    secret.write("API_KEY=hunter2\n")
    secret.flush()
    made_here = _Call(DupFd, secret.fileno())  # would register the server's own fd for sharing
    leak = _Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, made_here, 64)
    with pytest.raises(RefusedPayload, match="may not create a shared-memory descriptor"):
        deserialize(pickle.dumps(leak))
    assert os.path.getsize(tmp_path / "secret") == 16  # not truncated or grown
    secret.close()
    planted = tmp_path / "pymp-fake"  # a look-alike listener outside the temp dir's pymp-* dirs
    planted.mkdir()
    fake = DupFd.__new__(DupFd)
    fake._id = (str(planted / "listener-x"), 1)
    with pytest.raises(RefusedPayload, match="not a local multiprocessing listener"):
        deserialize(pickle.dumps(_Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, fake, 4)))
    empty = _Call(R.rebuild_typed_storage, _Call(R.rebuild_storage_empty, torch.storage.UntypedStorage),
                  torch.float32)
    grown = _Call(R.rebuild_tensor, torch.Tensor, empty, (0, (1024,), (1,), False))
    with pytest.raises(RefusedPayload, match="reaches past its storage"):
        deserialize(pickle.dumps(grown))
    negative = _Call(R.rebuild_tensor, torch.Tensor, empty, (0, (2,), (-1,), False))
    with pytest.raises(RefusedPayload, match="negative"):
        deserialize(pickle.dumps(negative))


def test_a_descriptor_smaller_than_its_storage_is_refused(tmp_path):
    """A real sender's descriptor (this process's resource sharer) to a 16-byte file, claimed as a
    1 MiB storage: mapping it would read past the file's end (SIGBUS), so it is refused."""
    from multiprocessing.resource_sharer import DupFd

    import torch.multiprocessing.reductions as R

    small = open(tmp_path / "small", "wb+")  # noqa: SIM115
    small.write(b"x" * 16)
    small.flush()
    oversized = _Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, DupFd(small.fileno()), 1 << 20)
    with pytest.raises(RefusedPayload, match="reaches past its shared-memory descriptor's file"):
        deserialize(pickle.dumps(oversized))
    fits = _Call(R.rebuild_storage_fd, torch.storage.UntypedStorage, DupFd(small.fileno()), 16)
    assert bytes(deserialize(pickle.dumps(fits)).tolist()) == b"x" * 16
    small.close()
