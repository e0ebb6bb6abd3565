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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from engine.core import EngineCore

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
        core = self.core
        outputs = core.drain()
        try:
            if msg.from_group is not None:  # received in full first: the trainer sends them all anyway
                try:
                    msg.named_tensors = self._receive(msg.from_group)
                except RuntimeError as exc:  # the trainer left or timed out mid-broadcast
                    raise ValueError(f"broadcast from group {msg.from_group.group_name!r} failed: {exc}") from exc
            if msg.model_path is not None:
                from engine.models.loader import load_safetensors

                load_safetensors(core.runner.model, msg.model_path)
            else:
                core.runner.model.load_weights(msg.named_tensors)
        except (ValueError, OSError) as exc:  # checked before any parameter was written
            return Reply((False, f"Weights not updated: {exc}"), outputs)
        message = "Success."
        if msg.weight_version is not None:
            core.weight_version = str(msg.weight_version)
            message += f" Weight version updated to {core.weight_version}."
        if msg.flush_cache and not core.scheduler.flush_cache():
            return Reply((False, NOT_FLUSHED), outputs)
        return Reply((True, message), outputs)

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
        import torch

        from weight_sync.nccl import parse_dtype

        group = self.groups.get(src.group_name)
        if group is None:
            raise ValueError(f"no weight update group {src.group_name!r}: call init_weights_update_group first")
        if not len(src.names) == len(src.dtypes) == len(src.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length "
                             f"({len(src.names)}, {len(src.dtypes)}, {len(src.shapes)})")
        device = self.core.runner.device
        return [(name, group.broadcast(torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)))
                for name, dtype, shape in zip(src.names, src.dtypes, src.shapes)]
