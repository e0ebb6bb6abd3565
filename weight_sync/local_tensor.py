"""SGLang's LocalSerializedTensor: one tensor as serialized payloads, one per tensor-parallel rank.

verl's weight sync (sglang.srt.weight_sync.utils.update_weights) gathers, on the trainer's TP
rank 0, each rank's MultiprocessingSerializer bytes of the full tensor (a handle into that rank's
GPU) and sends `[(name, LocalSerializedTensor(values=[bytes of rank 0, bytes of rank 1, ...]))]`,
itself serialized once per engine rank; engine rank r reads values[r]. SGLang defines the class in
`model_runner` and, since the model runner was split, in `model_runner_components.weight_updater`;
both names are accepted. tandem's rank 0 loads a serialized update and sends the tensors on to the
other ranks, so it reads its own value.

In a payload the class becomes a fresh RankValues subclass (per payload), whose state must be
exactly {"values": [bytes or base64 text, ...]}; each value is unpickled only when its rank's
tensor is wanted, through the same allowlist with tensor reductions only (no nesting further).
"""

from __future__ import annotations

from typing import Any

import torch

from weight_sync.rebuilds import refuse

SGLANG_CLASSES = frozenset({("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
                            ("sglang.srt.model_executor.model_runner_components.weight_updater",
                             "LocalSerializedTensor")})


class RankValues:
    """A LocalSerializedTensor's values, checked: a non-empty list of bytes or text."""

    def __new__(cls, *args: Any) -> "RankValues":
        if args:  # pickle's NEWOBJ passes none; anything else is a payload calling the class
            raise refuse("a LocalSerializedTensor is built from its state only")
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise refuse(f"a LocalSerializedTensor's state must be {{'values': [...]}}; got {_describe(state)}")
        self.values = checked_values(state["values"])

    @classmethod
    def of(cls, values: Any) -> "RankValues":
        out = cls()
        out.values = checked_values(values)
        return out

    def tensor(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s value, unpickled through the allowlist (tensor reductions only)."""
        from weight_sync.cuda_ipc import deserialize

        values = getattr(self, "values", None)
        if values is None:
            raise refuse("a LocalSerializedTensor without values")
        if rank >= len(values):
            raise refuse(f"a LocalSerializedTensor has {len(values)} value(s); tensor-parallel rank {rank} "
                         "has none")
        tensor = deserialize(values[rank], tensors_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise refuse(f"a LocalSerializedTensor's value holds a {type(tensor).__name__}, not a tensor")
        return tensor


def checked_values(values: Any) -> list:
    if not isinstance(values, list) or not values or not all(isinstance(v, (bytes, str)) for v in values):
        raise refuse(f"a LocalSerializedTensor's values must be a non-empty list of bytes; got {_describe(values)}")
    return list(values)


def is_local_serialized(value: Any) -> bool:
    """SGLang's class (either module) or ours, as a caller passes it in memory."""
    cls = type(value)
    return isinstance(value, RankValues) or (cls.__module__, cls.__qualname__) in SGLANG_CLASSES


def as_rank_values(named: Any) -> Any:
    """Pairs holding SGLang's LocalSerializedTensor objects -> the same pairs holding RankValues
    (plain data that travels to a core process); anything else is returned unchanged."""
    if not isinstance(named, (list, tuple)):
        return named
    pairs = [p for p in named if isinstance(p, tuple) and len(p) == 2]
    if len(pairs) != len(named) or not any(is_local_serialized(v) for _, v in pairs):
        return named
    return [(n, RankValues.of(getattr(v, "values", None)) if is_local_serialized(v) else v) for n, v in pairs]


def has_rank_values(named: Any) -> bool:
    return isinstance(named, list) and any(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], RankValues)
                                           for p in named)


def open_rank_values(named: Any, rank: int) -> Any:
    """Every RankValues in (name, value) pairs replaced by rank `rank`'s tensor; the rest kept."""
    if not isinstance(named, list):
        return named
    return [(p[0], p[1].tensor(rank)) if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], RankValues)
            else p for p in named]


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:5]}"
    if isinstance(value, list):
        return f"a list of {sorted({type(v).__name__ for v in value})}" if value else "an empty list"
    return f"a {type(value).__name__}"
