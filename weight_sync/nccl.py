"""Weights broadcast from a trainer (rank 0 of a WeightGroup) to engines: both ends.

Engine side, GroupSource: SGLang's `update_weights_from_distributed` request (names, dtypes,
shapes, group_name, load_format). With load_format None, one broadcast per name in that order (what
slime sends); with "flattened_bucket", one broadcast of the whole bucket packed as SGLang's
FlattenedTensorBucket (every tensor's bytes, in names order, back to back: weight_sync/bucket.py).
Trainer side, GroupSender: one flattened broadcast per bucket to every engine of the group at once,
pipelined: the next bucket is packed while the previous one is on the wire (at most two packed
buckets alive). The group itself: weight_sync/weight_group.py.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch

from weight_sync.base import LoadContext, WeightSender, WeightSource, WeightSyncError
from weight_sync.bucket import FlattenedBucket
from weight_sync.weight_group import DEFAULT_TIMEOUT_S, GroupBroken, WeightGroup, check_group_args  # noqa: F401 (the group's home)

logger = logging.getLogger("tandem")
LOAD_FORMATS = (None, "flattened_bucket")
OUT_OF_STEP = "nothing was received, so the trainer's broadcasts are now out of step with this engine"


def check_load_format(load_format: Optional[str]) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported for distributed updates; "
                         f"use None or 'flattened_bucket'")


def parse_dtype(dtype) -> torch.dtype:
    """torch.bfloat16 or "bfloat16" / "torch.bfloat16" (the HTTP body's form)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name such as 'bfloat16'")
    return found


@dataclass
class GroupSource(WeightSource):
    """Tensors the trainer (rank 0 of `group_name`) broadcasts: one per name, in this order, or
    (load_format "flattened_bucket") all of them in one buffer."""
    kind: ClassVar[str] = "distributed"
    every_rank_reads: ClassVar[bool] = True  # the trainer broadcasts to every rank of every engine
    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"
    load_format: Optional[str] = None

    def __post_init__(self) -> None:
        check_load_format(self.load_format)

    def load_into(self, model: Any, ctx: LoadContext) -> None:
        model.load_weights(self.receive(ctx))

    def discard(self, ctx: LoadContext) -> None:
        """Receive and drop (an update refused for a reason of the engine's own): the trainer's
        broadcasts stay in step with this engine's receives."""
        self.receive(ctx)

    def receive(self, ctx: LoadContext) -> list:
        """Every dtype and shape is checked before the first receive: a malformed list cannot be
        received in step with the trainer (a name is checked after, with the tensors in hand)."""
        group = ctx.groups.get(self.group_name)
        if group is None:
            raise ValueError(f"no weight update group {self.group_name!r}: call init_weights_update_group first")
        specs = self._specs()
        try:
            if self.load_format == "flattened_bucket":
                bucket = FlattenedBucket.empty(specs, ctx.device)
                group.broadcast(bucket.flattened_tensor, src=0)
                return bucket.unpack()
            tensors = [(name, torch.empty(shape, dtype=dtype, device=ctx.device)) for name, shape, dtype in specs]
            works = [group.start_broadcast(t, src=0) for _, t in tensors]  # queued in order, as the trainer's
            for work in works:
                group.wait(work)
            return tensors
        except GroupBroken as exc:  # the trainer died, never sent, or the group failed before
            raise ValueError(f"{exc}. Destroy the group (destroy_weights_update_group) and form it again") from exc

    def _specs(self) -> list:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, "
                             f"{len(self.dtypes)}, {len(self.shapes)}); {OUT_OF_STEP}")
        try:
            specs = [(str(name), tuple(int(d) for d in shape), parse_dtype(dtype))
                     for name, dtype, shape in zip(self.names, self.dtypes, self.shapes)]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{exc}; {OUT_OF_STEP}") from exc
        bad = next((name for name, shape, _ in specs if any(d < 0 for d in shape)), None)
        if bad is not None:
            raise ValueError(f"weight {bad!r} has a negative dimension; {OUT_OF_STEP}")
        return specs


@dataclass
class _InFlight:
    """A bucket on the wire: its packed buffer stays referenced until the broadcast is done."""
    bucket: FlattenedBucket
    work: Any
    replies: list  # a Future per engine: its (ok, message)


class GroupSender(WeightSender):
    """Trainer side: this process is rank 0 of `group`; every engine of `engines` joined it.

    send_all returns with the bucket still on the wire (the caller draws the next one meanwhile) and
    waits for it at the next call, before its own broadcast; the update's closing bucket (it sets
    the version or flushes) is waited for before returning, and so is a refusal, raised then."""
    kind: ClassVar[str] = "distributed"

    def __init__(self, group: WeightGroup, group_name: str = "weight_update_group") -> None:
        self.group, self.group_name = group, group_name
        self._in_flight: Optional[_InFlight] = None
        self._pool, self._pool_size = None, 0

    @classmethod
    def from_options(cls, group: Any = None, group_name: str = "weight_update_group", **_: Any) -> "GroupSender":
        if group is None:
            raise ValueError("transport 'distributed' needs group: this trainer's "
                             "weight_sync.weight_group.WeightGroup (rank 0)")
        return cls(group, group_name)

    def send(self, engine: Any, bucket: list, flush_cache: bool, weight_version: Optional[str]) -> tuple[bool, str]:
        """One bucket to one engine, waited for: its (ok, message)."""
        self.finish()
        self._start([engine], FlattenedBucket.pack(bucket), flush_cache, weight_version)
        return self._wait()[0]

    def send_all(self, engines: Sequence[Any], bucket: list, flush_cache: bool, weight_version: Optional[str]) -> None:
        packed = FlattenedBucket.pack(bucket)  # overlaps the previous bucket's broadcast
        self.finish()
        self._start(engines, packed, flush_cache, weight_version)
        if flush_cache or weight_version is not None:
            self.finish()

    def finish(self) -> None:
        """Wait for the bucket on the wire; raises WeightSyncError with an engine's refusal."""
        if self._in_flight is None:
            return
        refusals = [message for ok, message in self._wait() if not ok]
        if refusals:
            raise WeightSyncError(f"engine refused the weights: {refusals[0]}")

    def close(self) -> None:
        """After an update that failed mid-way (the trainer's runs raised): the bucket still on the
        wire is waited for, and every engine's receive call answered, so no engine is told to
        continue while its receive is still to come; its failure is logged (the caller is already
        raising). The reply threads end."""
        try:
            if self._in_flight is not None:
                self.finish()
        except WeightSyncError as exc:
            logger.warning("the weight update was abandoned; its last bucket also failed: %s", exc)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0

    def _start(self, engines: Sequence[Any], packed: FlattenedBucket, flush_cache: bool,
               weight_version: Optional[str]) -> None:
        names = [m.name for m in packed.metadata]
        dtypes = [str(m.dtype).removeprefix("torch.") for m in packed.metadata]
        shapes = [list(m.shape) for m in packed.metadata]
        try:  # first: a broken group is refused before any engine waits for this broadcast
            work = self.group.start_broadcast(packed.flattened_tensor.contiguous(), src=0)
        except GroupBroken as exc:
            raise WeightSyncError(str(exc)) from exc
        if self._pool_size < len(engines):
            if self._pool is not None:  # its threads are idle: the last bucket was waited for
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(len(engines), "tandem-weight-send"), len(engines)
        # every engine's receive call blocks until it has this broadcast: they run beside it
        replies = [self._pool.submit(engine.update_weights_from_distributed, names, dtypes, shapes, self.group_name,
                                     flush_cache=flush_cache, weight_version=weight_version,
                                     load_format="flattened_bucket") for engine in engines]
        self._in_flight = _InFlight(packed, work, replies)

    def _wait(self) -> list[tuple[bool, str]]:
        flight, self._in_flight = self._in_flight, None
        try:
            self.group.wait(flight.work)
        except GroupBroken as exc:  # an engine died or never joined the broadcast
            answers = [_answer(f, self._reply_timeout_s()) for f in flight.replies]
            raise WeightSyncError(f"{exc}; the engines answered: {[m for _, m in answers]}") from exc
        return [_answer(f, self._reply_timeout_s()) for f in flight.replies]

    def _reply_timeout_s(self) -> float:
        """An engine answers once it has the broadcast; one that does not within the group's own
        timeout (a client with none, a wedged engine) fails the update rather than hanging it."""
        timeout = getattr(self.group, "timeout", None)
        return timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S


def _answer(future: Future, timeout_s: float) -> tuple[bool, str]:
    try:
        ok, message = future.result(timeout=timeout_s)
    except FutureTimeout:
        return False, f"the engine did not answer its receive call within {timeout_s:g} s"
    except Exception as exc:  # e.g. an HTTP error: the engine's receive call raised
        return False, f"the engine's receive call raised {type(exc).__name__}: {exc}"
    return bool(ok), str(message)
