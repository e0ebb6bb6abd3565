"""FlattenedBucket: many tensors packed into one flat uint8 buffer + metadata, unpacked as views.

One buffer per transfer instead of one per tensor: one IPC handle, one NCCL broadcast. The format
is SGLang's FlattenedTensorBucket (`load_format="flattened_bucket"`: a dict {"flattened_tensor",
"metadata"}, offsets and sizes in bytes), so a payload built for SGLang loads here too. Buckets of
mixed dtypes are fine; callers choose the bucket size (verl and slime use hundreds of MB).
The byte layout (`bucket_layout`) and the cut into buckets (`split_by_bytes`) are written here
only: a sender packing, a receiver's empty buffer and a trainer's resident buckets all use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # bytes into the flat buffer
    end_idx: int
    numel: int  # bytes (SGLang's field name and unit)


class FlattenedBucket:
    def __init__(self, flattened_tensor: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> None:
        if not isinstance(flattened_tensor, torch.Tensor) or flattened_tensor.dtype != torch.uint8 \
                or flattened_tensor.dim() != 1:
            raise ValueError(f"a flattened bucket is a 1-D uint8 tensor; got {_describe(flattened_tensor)}")
        size = flattened_tensor.numel()
        for m in metadata:
            if not (isinstance(m, FlattenedTensorMetadata) and isinstance(m.name, str)
                    and isinstance(m.dtype, torch.dtype) and isinstance(m.start_idx, int)
                    and isinstance(m.end_idx, int)):
                raise ValueError(f"bucket metadata entries must be FlattenedTensorMetadata(name: str, shape, "
                                 f"dtype: torch.dtype, start_idx: int, end_idx: int, numel); got {m!r}")
            nbytes = m.dtype.itemsize * _numel(m.shape)
            if not 0 <= m.start_idx <= m.end_idx <= size or m.end_idx - m.start_idx != nbytes:
                raise ValueError(f"bucket entry {m.name!r}: bytes [{m.start_idx}, {m.end_idx}) do not hold "
                                 f"{list(m.shape)} {m.dtype} in a buffer of {size} bytes")
        self.flattened_tensor = flattened_tensor
        self.metadata = metadata

    @classmethod
    def pack(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> "FlattenedBucket":
        """One copy of every tensor into a fresh buffer on the tensors' device."""
        named = list(named_tensors)
        metadata, _ = bucket_layout((name, t.shape, t.dtype) for name, t in named)
        parts = [t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        return cls(buffer, metadata)

    @classmethod
    def empty(cls, specs: Iterable[tuple[str, Any, torch.dtype]], device: Any = None) -> "FlattenedBucket":
        """An uninitialised buffer laid out for (name, shape, dtype) specs: a broadcast's receive
        buffer, or a trainer's parameters kept resident in buckets."""
        metadata, total = bucket_layout(specs)
        return cls(torch.empty(total, dtype=torch.uint8, device=device), metadata)

    @classmethod
    def from_payload(cls, payload: Any) -> "FlattenedBucket":
        """The {"flattened_tensor", "metadata"} dict SGLang's format sends (or a bucket)."""
        if isinstance(payload, FlattenedBucket):
            return payload
        if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"} \
                or not isinstance(payload["metadata"], (list, tuple)):
            raise ValueError('a flattened_bucket payload is {"flattened_tensor": uint8 tensor, '
                             '"metadata": [FlattenedTensorMetadata, ...]}')
        return cls(payload["flattened_tensor"], list(payload["metadata"]))

    def to_payload(self) -> dict:
        return {"flattened_tensor": self.flattened_tensor, "metadata": self.metadata}

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) per entry: a view into the buffer, or a copy where the entry's offset is
        not a multiple of its dtype's size (mixed-dtype buckets pack without padding). Entries
        back to back in one dtype are cut from one typed view by one split (hundreds of small
        LoRA tensors: per-entry slicing was most of the time)."""
        out = []
        for run in _runs(self.metadata):
            first, last = run[0], run[-1]
            raw = self.flattened_tensor[first.start_idx:last.end_idx]
            if first.start_idx % first.dtype.itemsize:
                raw = raw.clone()
            typed = raw.view(first.dtype)
            parts = typed.split([(m.end_idx - m.start_idx) // m.dtype.itemsize for m in run])
            # view(*ints): a torch.Size argument takes a slower parse, twice the time of the view
            out += [(m.name, part.view(*m.shape) if m.shape else part.view(())) for m, part in zip(run, parts)]
        return out


def bucket_layout(specs: Iterable[tuple[str, Any, torch.dtype]]) -> tuple[list[FlattenedTensorMetadata], int]:
    """SGLang's layout of (name, shape, dtype) specs: bytes back to back in order, no padding.
    -> (metadata, total bytes)."""
    metadata, offset = [], 0
    for name, shape, dtype in specs:
        shape = torch.Size(shape)
        nbytes = dtype.itemsize * shape.numel()
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata, offset


def split_by_bytes(named: Sequence[tuple[str, Any]], bucket_bytes: int,
                   nbytes: Callable[[Any], int] = lambda t: t.numel() * t.element_size()) -> Iterator[list]:
    """Consecutive runs of at most bucket_bytes by `nbytes` (a larger item goes alone); an empty
    input gives one empty run."""
    bucket: list = []
    size = 0
    for name, t in named:
        n = nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket or not named:
        yield bucket


def _runs(metadata: Sequence[FlattenedTensorMetadata]) -> Iterator[list[FlattenedTensorMetadata]]:
    """Consecutive entries of one dtype, each starting where the last ended, at offsets that are
    multiples of the dtype's size (a misaligned entry is a run alone: unpack copies it)."""
    run: list[FlattenedTensorMetadata] = []
    for m in metadata:
        if run and (m.dtype != run[-1].dtype or m.start_idx != run[-1].end_idx or m.start_idx % m.dtype.itemsize):
            yield run
            run = []
        run.append(m)
    if run:
        yield run


def _numel(shape: Any) -> int:
    if not isinstance(shape, (tuple, list)):  # torch.Size is a tuple
        raise ValueError(f"a bucket entry's shape must be a tuple of ints, got {type(shape).__name__}")
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ValueError(f"shape {list(shape)} has a dimension that is not a non-negative int")
        n *= d
    return n


def _describe(x: Any) -> str:
    return f"{x.dtype} with shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
