"""The tensor transport: tensors handed over in memory, or by reference from another process.

Engine side: `tensor_source` turns what `update_weights_from_tensor` was given into a source.
Pairs or a flattened bucket become a TensorSource, checked in the caller's thread. A serialized
payload (weight_sync.cuda_ipc.serialize bytes or base64 text, SGLang's `serialized_named_tensors`
entry), or pairs holding SGLang's LocalSerializedTensor (weight_sync.local_tensor: a serialized
tensor per rank), becomes a SerializedSource, opened in the core's process: that is the one place a
payload is deserialized, whoever carried it (the HTTP route, a Ray actor, an in-process caller).
Opening may wait on the sender (a descriptor fetched over its socket), so the core runs `open`
off its step, bounded (engine/core/payload_opener.py), and loads the TensorSource it returns.
Trainer side: TensorSender packs each bucket into one FlattenedBucket (one IPC handle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch

from weight_sync.base import LoadContext, WeightSender, WeightSource
from weight_sync.bucket import FlattenedBucket
from weight_sync.local_tensor import as_rank_values, has_rank_values, open_rank_values

LOAD_FORMATS = (None, "direct", "flattened_bucket")


def check_tensor_load_format(load_format: Optional[str]) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use None, 'direct' or 'flattened_bucket'")


def tensor_source(named_tensors: Any, load_format: Optional[str] = None) -> WeightSource:
    """[(name, tensor)], a FlattenedBucket or its payload dict (load_format "flattened_bucket"),
    or any of those serialized, or pairs holding SGLang's LocalSerializedTensor -> the source that
    loads it; a ValueError for anything else."""
    named_tensors = as_rank_values(named_tensors)
    if isinstance(named_tensors, (bytes, str)) or has_rank_values(named_tensors):
        return SerializedSource(named_tensors, load_format)
    return TensorSource(named_tensors, load_format)


@dataclass
class TensorSource(WeightSource):
    """HF-named tensors in memory: pairs, or a flattened bucket unpacked (into views) as it loads.
    Checked when built: a ValueError naming what was passed instead."""
    kind: ClassVar[str] = "tensor"
    named_tensors: Any
    load_format: Optional[str] = None

    def __post_init__(self) -> None:
        check_tensor_load_format(self.load_format)
        if self.load_format == "flattened_bucket":
            self.named_tensors = FlattenedBucket.from_payload(self.named_tensors)
        else:
            self.named_tensors = _checked_pairs(self.named_tensors)

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        named = self.named_tensors
        if isinstance(named, FlattenedBucket):
            try:
                named = named.unpack()
            except (ValueError, RuntimeError) as exc:  # before any write: a refusal, not a partial update
                raise ValueError(f"flattened bucket refused: {type(exc).__name__}: {exc}") from exc
        model.load_weights(named)


@dataclass
class SerializedSource(WeightSource):
    """A payload still serialized (bytes or base64 text of the whole, or pairs whose tensors are
    each serialized per rank): unpickled through the allowlist inside the core's own process, where
    the weights are loaded. CUDA memory opened from an IPC handle cannot be shared on to another
    process, so a front end that opened it could not hand it to a core process; this source never
    opens it there. `open` may wait on the sender; `load_into` opens first if nobody did."""
    kind: ClassVar[str] = "serialized"
    data: Union[bytes, str, list]
    load_format: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, str)) and not has_rank_values(self.data):
            raise ValueError(f"a serialized payload is bytes or base64 text; got {type(self.data).__name__}")
        check_tensor_load_format(self.load_format)

    def open(self, tp_rank: int = 0) -> TensorSource:
        """The tensors, opened from their handles (rank `tp_rank`'s value of a LocalSerializedTensor:
        tandem's rank 0 loads and sends the tensors on); a ValueError naming what was refused."""
        from weight_sync.cuda_ipc import PAYLOAD_ERRORS, RefusedPayload, deserialize

        try:
            named = deserialize(self.data) if isinstance(self.data, (bytes, str)) else self.data
            return TensorSource(open_rank_values(named, tp_rank), self.load_format)
        except RefusedPayload:  # says what was refused
            raise
        except (*PAYLOAD_ERRORS, RuntimeError) as exc:  # bad pairs or bucket metadata, an IPC handle that
            # cannot be opened: nothing is written yet
            raise ValueError(f"payload refused: {type(exc).__name__}: {exc}") from exc

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        self.open().load_into(model, ctx)


class TensorSender(WeightSender):
    """Each bucket packed into one FlattenedBucket and handed to `update_weights_from_tensor`
    (in process; an HTTP or Ray client sends the payload by reference, cuda_ipc)."""
    kind: ClassVar[str] = "tensor"

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        payload = FlattenedBucket.pack(bucket).to_payload()
        return engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=flush_cache,
                                                 weight_version=weight_version)


def _checked_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    try:
        named = list(named_tensors)
    except TypeError:
        raise ValueError(f"named_tensors must be (name, tensor) pairs; got {type(named_tensors).__name__}") from None
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            held = f" holding {type(item[1]).__name__}" if isinstance(item, tuple) and len(item) == 2 else ""
            raise ValueError(f"named_tensors must be (name, tensor) pairs; got a {type(item).__name__}{held}")
    return named
