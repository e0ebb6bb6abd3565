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
