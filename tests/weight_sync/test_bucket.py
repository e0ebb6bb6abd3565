"""FlattenedBucket: pack / unpack round trips bitwise, in SGLang's payload format."""

from __future__ import annotations

import pytest
import torch

from weight_sync.bucket import FlattenedBucket, FlattenedTensorMetadata


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=g).bfloat16()),  # 30 bytes: the next is misaligned
            ("b.weight", torch.randn(7, generator=g)),
            ("c.bias", torch.randn(2, 2, generator=g).half()),
            ("d.scalar", torch.tensor(1.5, dtype=torch.float64))]


def test_round_trip_is_bitwise_with_byte_offsets():
    named = _tensors()
    bucket = FlattenedBucket.pack(named)
    assert bucket.flattened_tensor.dtype == torch.uint8
    assert bucket.flattened_tensor.numel() == sum(t.numel() * t.element_size() for _, t in named)
    assert [(m.start_idx, m.end_idx, m.numel) for m in bucket.metadata][:2] == [(0, 30, 30), (30, 58, 28)]
    again = FlattenedBucket.from_payload(bucket.to_payload()).unpack()
    for (name, t), (name2, u) in zip(named, again):
        assert name == name2 and u.dtype == t.dtype and u.shape == t.shape
        assert torch.equal(u.view(torch.uint8) if u.dim() else u, t.view(torch.uint8) if t.dim() else t)
    first = again[0][1]  # aligned entries are views of the buffer, not copies
    assert first.data_ptr() == bucket.flattened_tensor.data_ptr()


def test_bad_payloads_are_named():
    bucket = FlattenedBucket.pack(_tensors()[:1])
    with pytest.raises(ValueError, match="flattened_tensor"):
        FlattenedBucket.from_payload({"tensor": bucket.flattened_tensor})
    with pytest.raises(ValueError, match="1-D uint8"):
        FlattenedBucket(bucket.flattened_tensor.float(), bucket.metadata)
    wrong = FlattenedTensorMetadata("a.weight", torch.Size([4, 5]), torch.bfloat16, 0, 30, 30)
    with pytest.raises(ValueError, match="'a.weight'"):
        FlattenedBucket(bucket.flattened_tensor, [wrong])
    assert FlattenedBucket.pack([]).unpack() == []
