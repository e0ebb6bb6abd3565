"""The two ends of a weight update, each behind a small base class and a registry by name.

WeightSource (engine side): where an update's tensors come from. Engine.update_weights(source)
sends one in an UpdateWeightsReq into the core, which calls `load_into` between two steps; a
source checks every name, shape and dtype before it writes a parameter (the model's
`load_weights` does for pairs). Every SGLang-named update method builds one.
WeightSender (trainer side): moves a bucket of (name, tensor) to an engine over one transport.
A new transport is one module here with a source and a sender, registered by name.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
    """Engine.update_weights(source) hands one to the core; `load_into` runs there, between two
    steps, and calls `model.load_weights([(HF name, tensor)])` (which checks every pair before
    writing any). Arguments are checked when the source is built, in the caller's thread.
    every_rank_reads: each tensor-parallel rank reads the source itself (a checkpoint, a trainer's
    broadcast to the whole group); otherwise rank 0 loads it and sends its tensors to the others.
    A source whose sender waits on the engine (a broadcast) also has `discard(ctx)`: an update
    refused before loading still takes what was sent, and drops it, to stay in step.
    A source that must first fetch its tensors from the sender (a serialized payload's handles)
    also has `open() -> WeightSource`: the core runs it off its step, bounded, then loads the result.
    success_message: the reply on success, where SGLang words it exactly (else "Success." and the
    new version)."""
    kind: ClassVar[str] = ""
    every_rank_reads: ClassVar[bool] = False
    success_message: ClassVar[Optional[str]] = None

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
