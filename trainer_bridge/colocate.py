"""The colocated step: engines lend their GPU memory to the trainer, then take the new weights.

engine release (weights, KV cache, CUDA graphs) -> train step in the freed memory -> engine
resumes weights and CUDA graphs -> push the new weights (trainer_bridge.sync.push_weights) ->
engine resumes its KV cache -> generation continues. Weights come back before the KV so the new
weights land while the KV pool is still away (old weights, new weights and KV are never resident
together: the OOM at wake users of other stacks report). Engines are engine.api.protocol EngineAPIs
(in process, HTTP, Ray actors); several are released, resumed and pushed to concurrently.

An engine is never left released: if the train step or the push fails, every engine still gets
its memory back (its weights then are whatever the release kept, so push before generating) and
the error is raised.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from engine.phase_clock import PhaseClock
from trainer_bridge.sync import on_all_engines

T = TypeVar("T")
WEIGHT_TAGS = ["weights", "cuda_graph"]  # back before the push: the push writes into the weights
KV_TAGS = ["kv_cache"]  # back last


class ColocateError(RuntimeError):
    pass


@dataclass(frozen=True)
class ColocatePhases:
    """Seconds spent in each phase of one colocated step (slowest engine where several)."""
    release: float
    train: float
    return_cache: float  # the train step's cached activations handed back to the driver (for the engines)
    resume_weights: float
    push: float
    resume_kv: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class PushConfig:
    transport: str = "tensor"  # trainer_bridge.sync.TRANSPORTS; "tensor" is CUDA IPC on a GPU
    pause_mode: str = "retract"
    bucket_bytes: int = 512 << 20


def colocated_step(engines: Sequence[Any], train_step: Callable[[], T], push: Callable[[], Any],
                   keep_cuda_graphs: bool = False, keep_weights: bool = False) -> tuple[T, ColocatePhases]:
    """-> (train_step's result, the phase times). push runs once, after the train step, while the
    engines hold their weights but not their KV (trainer_bridge.sync.push_to_engines, say).
    keep_cuda_graphs: the graphs' memory pool stays mapped through the step (a released pool is
    unmapped and mapped back at the same addresses; the graphs replay either way, never
    re-captured). keep_weights (LoRA RL: the push is an adapter, the base never changes): the
    weights stay resident, since a release without a CPU backup would leave them undefined with
    nothing to rewrite them."""
    if not engines:
        raise ValueError("colocated_step needs at least one engine")
    kept = (["cuda_graph"] if keep_cuda_graphs else []) + (["weights"] if keep_weights else [])
    released = [tag for tag in WEIGHT_TAGS + KV_TAGS if tag not in kept]
    clock = PhaseClock()
    resumed: list[str] = []
    lent = LentMemory()
    try:
        with clock.phase("release"):
            tags = released if kept else None  # None: every tag
            with lent.measure():
                on_all_engines(engines, lambda e: _memory(e.release_memory_occupation, tags, "release"))
        with clock.phase("train"):
            result = train_step()
        with clock.phase("return_cache"):  # timed apart: when returned, the next step allocates them again
            lent.return_cache_if_needed()
        with clock.phase("resume_weights"):
            early = [tag for tag in WEIGHT_TAGS if tag in released]
            if early:
                on_all_engines(engines, lambda e: _resume(e, early))
            resumed += early
        with clock.phase("push"):
            push()
            lent.return_cache_if_needed()
    except BaseException:
        lent.return_cache_if_needed()  # the step's own return may not have run before the error
        raise
    finally:
        missing = [tag for tag in released if tag not in resumed]
        with clock.phase("resume_kv"):
            on_all_engines(engines, lambda e: _resume(e, missing))
    return result, ColocatePhases(**clock.phases)


class LentMemory:
    """The device memory the engines' release freed, and the trainer's cached blocks returned to
    the driver only when the engines' resume would not find it free without them. The train
    step's activations (and a ZeRO-3 push's gathered buckets) stay cached in this process's
    allocator after they die; returning them every step made each next step cudaMalloc them again
    (the train phase's spread on the H200), while on a device with room for both (the 0.6B
    recipe: an engine share of ~49 GB beside a ~34 GB trainer) nothing needs them back. A
    Qwen3-4B step did need them: too little was left for the engine's resume."""

    # Room kept beyond what the release freed: the engine's own activations while it generates
    # (a long prefill's float32 logits: ~5 GB for 8k tokens of a 152k vocabulary), the resume's
    # allocations, other processes.
    MARGIN = 8 << 30

    def __init__(self) -> None:
        self.bytes: Optional[int] = None  # None: not measured (no CUDA): return every time

    @contextmanager
    def measure(self) -> Iterator[None]:
        before = _free_device_bytes()
        yield
        after = _free_device_bytes()
        if before is not None and after is not None:
            self.bytes = max(0, after - before)

    def return_cache_if_needed(self) -> None:
        free = _free_device_bytes()
        if self.bytes is None or free is None or free < self.bytes + self.MARGIN:
            _empty_cache()


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _free_device_bytes() -> Optional[int]:
    """Free bytes on the current device (the trainer's; colocated engines share it)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.mem_get_info()[0]
    return None


def _resume(engine: Any, tags: Any) -> None:
    """Resume, and once more with every cached block of this process returned if the engine
    refused: a kept cache must never be what keeps an engine from its memory (a release that
    freed less than the resume needs, say after an earlier failed resume)."""
    try:
        _memory(engine.resume_memory_occupation, tags, "resume")
    except ColocateError:
        _empty_cache()
        _memory(engine.resume_memory_occupation, tags, "resume")


def _memory(verb: Callable, tags: Any, what: str) -> None:
    ok, message = verb(tags)
    if not ok:
        raise ColocateError(f"engine refused to {what} memory {tags or 'all'}: {message}")
