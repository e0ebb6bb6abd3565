"""The two ends of a weight update, each behind a small base class and a registry by name.

WeightSource (engine side): where an update's tensors come from. One source rides in an
UpdateWeightsReq into the core, which calls `load_into` between two steps; a source checks every
name, shape and dtype before it writes a parameter (the model's `load_weights` does for pairs).
WeightSender (trainer side): moves a bucket of (name, tensor) to an engine over one transport.
A new transport is one module here with a source and a sender, registered by name.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

SOURCES: dict[str, type["WeightSource"]] = {}
SENDERS: dict[str, type["WeightSender"]] = {}


@dataclass
class LoadContext:
    """What a source may use on the core: the device, the open broadcast groups and the engine's
    checkpoint loader `(model, path) -> None` (passed in: weight_sync imports nothing of engine/)."""
    device: torch.device
    groups: dict[str, Any] = field(default_factory=dict)
    load_checkpoint: Optional[Callable[[Any, str], None]] = None


class WeightSource:
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            SOURCES[cls.kind] = cls

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        raise NotImplementedError


class WeightSender:
    """Trainer side: `send` one bucket of (name, tensor) to an engine and return its (ok, message);
    the last bucket of an update flushes and sets the version. `bucketed` False: the transport
    takes the whole update at once (a checkpoint), in one send."""
    kind: ClassVar[str] = ""
    bucketed: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            SENDERS[cls.kind] = cls

    @classmethod
    def from_options(cls, **options: Any) -> "WeightSender":
        """Built by name (trainer_bridge.sync.push_weights): take the options this transport needs."""
        return cls()

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        raise NotImplementedError

    def send_all(self, engines: Sequence[Any], bucket: list, flush_cache: bool, weight_version: Optional[str]) -> None:
        """The bucket to every engine at once; raises WeightSyncError with the first refusal. A
        transport that reaches every engine in one operation (a broadcast) overrides this."""
        def one(engine: Any) -> None:
            ok, message = self.send(engine, bucket, flush_cache, weight_version)
            if not ok:
                raise WeightSyncError(f"engine refused the weights: {message}")

        on_all_engines(engines, one)

    def close(self) -> None:
        """At the end of an update, also one that failed mid-way: whatever the transport still
        has in flight lands (or fails) before the engines continue. Nothing, for most."""


class WeightSyncError(RuntimeError):
    """An engine refused a bucket; its reason is the message."""


def on_all_engines(engines: Sequence[Any], fn: Callable[[Any], Any]) -> None:
    """fn on every engine at once (a thread each); every engine gets its call even if one fails,
    then the first failure is raised."""
    if len(engines) == 1:
        fn(engines[0])
        return
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        futures = [pool.submit(fn, e) for e in engines]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def transports() -> tuple[str, ...]:
    """Every sender's name. Senders register as their modules load; each module of this package
    is imported here, so a new transport is a new module and nothing else."""
    for module in pkgutil.iter_modules(_package_path()):
        importlib.import_module(f"{__package__}.{module.name}")
    return tuple(SENDERS)


def sender_for(transport: str, **options: Any) -> WeightSender:
    names = transports()
    if transport not in SENDERS:
        raise ValueError(f"transport must be one of {', '.join(names)}; got {transport!r}")
    return SENDERS[transport].from_options(**options)


def _package_path() -> list[str]:
    return [os.path.dirname(__file__)]


def check_tensor_load_format(load_format: Optional[str]) -> None:
    if load_format not in (None, "direct", "flattened_bucket"):
        raise ValueError(f"load_format {load_format!r} is not supported; use None, 'direct' or 'flattened_bucket'")


def named_pairs(named_tensors: Any, load_format: Optional[str] = None) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] from pairs or (load_format="flattened_bucket") a FlattenedBucket or its
    payload dict; a ValueError naming what was passed instead."""
    check_tensor_load_format(load_format)
    if load_format == "flattened_bucket":
        from weight_sync.bucket import FlattenedBucket

        named_tensors = FlattenedBucket.from_payload(named_tensors).unpack()
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


@dataclass
class TensorSource(WeightSource):
    """HF-named tensors handed over in memory (in process, or by reference across processes)."""
    kind: ClassVar[str] = "tensor"
    named_tensors: list

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        model.load_weights(self.named_tensors)
