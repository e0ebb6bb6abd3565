"""GenerationControl: pause / continue generation and weight updates, run between steps.

Every message here runs on the core thread between two steps, after the launched (overlap) batch
is finished, so no forward pass ever sees half-loaded weights and every token is attributed to
the weights that produced it. The RL protocol (DESIGN section 5) is the caller's sequence:
pause (abort | retract | in_place) -> update weights (tensors or a checkpoint; names, shapes and
completeness are checked before any parameter is written) -> flush the radix cache (its KV is
stale) -> new weight_version -> continue. Semantics and messages follow SGLang's
(shared/reference/sglang-rl-api.md 1.2, 1.5, 1.6, 1.9).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still "
               "running; pause with mode='retract' or 'abort' first, or flush the cache later.")


@dataclass
class PauseReq:
    mode: str = "abort"


@dataclass
class ContinueReq:
    pass


@dataclass
class FromGroup:
    """Tensors the trainer (rank 0 of `group_name`) broadcasts, one per name, in this order."""
    names: list[str]
    dtypes: list[Any]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


@dataclass
class UpdateWeightsReq:
    """Exactly one source: HF-named tensors, a safetensors checkpoint directory, or a group."""
    named_tensors: Optional[list] = None
    model_path: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None
    from_group: Optional[FromGroup] = None


@dataclass
class InitWeightsGroupReq:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class DestroyWeightsGroupReq:
    group_name: str = "weight_update_group"


@dataclass
class SetWeightVersionReq:
    new_version: str


@dataclass
class Reply:
    """A control message's return value, plus the outputs it produced (tokens of the drained
    batch, requests it aborted) for the front end to deliver."""
    value: Any
    outputs: list = field(default_factory=list)


CONTROL_MESSAGES = (PauseReq, ContinueReq, UpdateWeightsReq, SetWeightVersionReq, InitWeightsGroupReq,
                    DestroyWeightsGroupReq)


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    return mode


class GenerationControl:
    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.groups: dict[str, Any] = {}  # group name -> weight_sync.nccl.WeightGroup
        self.num_updates = 0  # successful loads (a bucket each), for /metrics
        self.update_seconds = 0.0  # time in them: receive + load + flush

    def handle(self, msg: Any) -> Reply:
        if isinstance(msg, PauseReq):
            return self._pause(check_pause_mode(msg.mode))
        if isinstance(msg, ContinueReq):
            self.core.paused = False
            return Reply(None)
        if isinstance(msg, UpdateWeightsReq):
            return self._update_weights(msg)
        if isinstance(msg, SetWeightVersionReq):
            self.core.weight_version = str(msg.new_version)
            return Reply(self.core.weight_version)
        if isinstance(msg, InitWeightsGroupReq):
            return Reply(self._init_group(msg))
        if isinstance(msg, DestroyWeightsGroupReq):
            group = self.groups.pop(msg.group_name, None)
            if group is not None:
                group.destroy()
            return Reply((group is not None, f"group {msg.group_name!r} " + ("destroyed" if group else "not found")))
        raise TypeError(f"unknown control message {type(msg).__name__}")

    def _pause(self, mode: str) -> Reply:
        core = self.core
        core.paused = True
        outputs = core.drain()
        if mode == "abort":  # waiting requests end now, running ones once released here
            outputs += core.abort_all("aborted: generation paused")
        elif mode == "retract":  # back to the queue with their outputs; KV stays in the tree, evictable
            core.scheduler.retract_all()
        return Reply(None, outputs)

    def _update_weights(self, msg: UpdateWeightsReq) -> Reply:
        outputs = self.core.drain()  # the drained tokens are the old weights'; delivered whatever follows
        start = time.perf_counter()
        try:
            value = self._load(msg)
            elapsed = time.perf_counter() - start
            self.num_updates += 1
            self.update_seconds += elapsed
            logger.info("weights updated in %.3f s: version %s%s", elapsed, self.core.weight_version,
                        "" if value[0] else f" ({value[1]})")
        except (ValueError, OSError) as exc:  # names, shapes, dtypes, completeness: checked before writing
            value = (False, f"Weights not updated: {exc}")
        except Exception as exc:  # e.g. a corrupt file or a failed copy: still answered
            logger.exception("weight update failed")
            value = (False, f"Weight update failed (weights may be partly written): {type(exc).__name__}: {exc}")
        return Reply(value, outputs)

    def _load(self, msg: UpdateWeightsReq) -> tuple[bool, str]:
        core = self.core
        if msg.model_path is not None:
            from engine.models.loader import load_safetensors

            load_safetensors(core.runner.model, msg.model_path)
        else:  # a group's tensors are received in full first: the trainer sends them all anyway
            named = self._receive(msg.from_group) if msg.from_group is not None else msg.named_tensors
            core.runner.model.load_weights(named)
        message = "Success."
        if msg.weight_version is not None:  # the version names the weights now loaded, flushed or not
            core.weight_version = str(msg.weight_version)
            message += f" Weight version updated to {core.weight_version}."
        if msg.flush_cache and not core.scheduler.flush_cache():
            return False, NOT_FLUSHED
        return True, message

    def _init_group(self, msg: InitWeightsGroupReq) -> tuple[bool, str]:
        """Blocks until the trainer (rank 0) joins: it calls the same rendezvous at the same time."""
        from weight_sync.nccl import WeightGroup

        if msg.group_name in self.groups:
            return False, f"weight update group {msg.group_name!r} already exists"
        try:
            self.groups[msg.group_name] = WeightGroup(msg.master_address, msg.master_port, msg.rank_offset,
                                                      msg.world_size, msg.group_name, msg.backend)
        except (ValueError, RuntimeError) as exc:  # bad arguments, rendezvous timeout, no NCCL
            return False, f"Failed to init weight update group {msg.group_name!r}: {exc}"
        return True, "Succeeded to initialize custom process group."

    def _receive(self, src: FromGroup) -> list:
        """Every dtype and shape is checked before the first receive: a malformed list cannot be
        received in step with the trainer (a name is checked after, with the tensors in hand)."""
        import torch

        from weight_sync.nccl import parse_dtype

        group = self.groups.get(src.group_name)
        if group is None:
            raise ValueError(f"no weight update group {src.group_name!r}: call init_weights_update_group first")
        if not len(src.names) == len(src.dtypes) == len(src.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length "
                             f"({len(src.names)}, {len(src.dtypes)}, {len(src.shapes)}); nothing was "
                             "received, so the trainer's broadcasts are now out of step with this engine")
        try:
            specs = [(str(name), parse_dtype(dtype), tuple(int(d) for d in shape))
                     for name, dtype, shape in zip(src.names, src.dtypes, src.shapes)]
            bad = next((name for name, _, shape in specs if any(d < 0 for d in shape)), None)
            if bad is not None:
                raise ValueError(f"weight {bad!r} has a negative dimension")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{exc}; nothing was received, so the trainer's broadcasts are now out of "
                             "step with this engine") from exc
        device = self.core.runner.device
        try:
            return [(name, group.broadcast(torch.empty(shape, dtype=dtype, device=device)))
                    for name, dtype, shape in specs]
        except RuntimeError as exc:  # the trainer left or timed out mid-broadcast
            raise ValueError(f"broadcast from group {src.group_name!r} failed: {exc}") from exc
