"""The tensors of /load_lora_adapter_from_tensors: a serialized payload (SGLang's
MultiprocessingSerializer, or weight_sync.cuda_ipc.serialize; bytes or base64 text) opened
through the same allowlist unpickler as weight payloads, so it can hold tensors and names only;
or tensors in memory. Either form is {name: tensor}, (name, tensor) pairs, or with load_format
"flattened_bucket" SGLang's {"flattened_tensor", "metadata"} bucket.

A serialized payload is a SerializedLoRATensors: the core's worker opens it off the step, bounded
in time (engine/core/payload_opener.py), as it opens weight payloads, since opening may wait on
the sender; what comes back (or an in-memory form) is LoRATensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

LOAD_FORMATS = (None, "direct", "flattened_bucket")


@dataclass
class LoRATensors:
    """Opened tensors: (name, tensor) pairs, or a flattened-bucket payload still to unpack."""
    data: Any
    load_format: Optional[str] = None

    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        return open_lora_tensors(self.data, self.load_format)


@dataclass
class SerializedLoRATensors:
    data: Union[bytes, str]
    load_format: Optional[str] = None

    def open(self) -> LoRATensors:
        """Unpickled through the allowlist (a flattened bucket unpacked): a ValueError naming what
        was refused, nothing of it run."""
        return LoRATensors(open_lora_tensors(self.data, self.load_format))


def lora_tensors(data: Any, load_format: Optional[str]) -> Union[LoRATensors, SerializedLoRATensors]:
    _check_load_format(load_format)
    if isinstance(data, (bytes, str)):
        return SerializedLoRATensors(data, load_format)
    return LoRATensors(data, load_format)


def open_lora_tensors(tensors: Any, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """-> (name, tensor) pairs; a ValueError naming what was refused (nothing of it is run)."""
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import PAYLOAD_ERRORS, RefusedPayload, deserialize

    _check_load_format(load_format)
    try:
        if isinstance(tensors, (bytes, str)):
            tensors = deserialize(tensors)
        if load_format == "flattened_bucket":
            return FlattenedBucket.from_payload(tensors).unpack()
    except RefusedPayload:
        raise
    except (*PAYLOAD_ERRORS, RuntimeError) as exc:
        raise ValueError(f"LoRA tensors refused: {type(exc).__name__}: {exc}") from None
    pairs = list(tensors.items()) if isinstance(tensors, dict) else tensors
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in pairs):
        raise ValueError(f"LoRA tensors must be {{name: tensor}} or (name, tensor) pairs; got {type(tensors).__name__}")
    return [(name, tensor) for name, tensor in pairs]


def _check_load_format(load_format: Optional[str]) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use None, 'direct' or 'flattened_bucket'")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order, as Miles computes its expected_checksums."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()).hexdigest()


def check_checksums(pairs: list[tuple[str, torch.Tensor]], expected: dict) -> None:
    """ValueError naming the tensors whose bytes are not what the sender hashed (or that are missing)."""
    got = dict(pairs)
    missing = sorted(name for name in expected if name not in got)
    wrong = sorted(name for name, digest in expected.items() if name in got and tensor_sha256(got[name]) != digest)
    problems = ([f"{len(wrong)} tensors differ from what was sent ({', '.join(wrong[:5])})"] if wrong else []) + (
        [f"{len(missing)} are missing ({', '.join(missing[:5])})"] if missing else [])
    if problems:
        raise ValueError(f"expected_checksums: {' and '.join(problems)}; nothing was loaded")
