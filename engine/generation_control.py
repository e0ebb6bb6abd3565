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
class UpdateWeightsReq:
    """Exactly one source: HF-named tensors, or a safetensors checkpoint directory."""
    named_tensors: Optional[list] = None
    model_path: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None


@dataclass
class SetWeightVersionReq:
    new_version: str


@dataclass
class Reply:
    """A control message's return value, plus the outputs it produced (tokens of the drained
    batch, requests it aborted) for the front end to deliver."""
    value: Any
    outputs: list = field(default_factory=list)


CONTROL_MESSAGES = (PauseReq, ContinueReq, UpdateWeightsReq, SetWeightVersionReq)


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    return mode


class GenerationControl:
    def __init__(self, core: "EngineCore") -> None:
        self.core = core

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
