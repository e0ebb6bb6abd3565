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
from typing import TYPE_CHECKING, Any, Protocol

from engine.core.messages import (ContinueReq, DestroyWeightsGroupReq, InitWeightsGroupReq, PauseReq, ReleaseMemoryReq,
                                  Reply, ResumeMemoryReq, SetWeightVersionReq, UpdateWeightsReq, check_memory_tags,
                                  check_pause_mode)

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still "
               "running; pause with mode='retract' or 'abort' first, or flush the cache later.")


class ControlledCore(Protocol):
    """What control reads and changes of the EngineCore (which imports this module, so no import
    back): its pause flag, weight version and released memory, its parts, and two of its steps."""
    paused: bool
    weight_version: str
    memory_released: set[str]
    scheduler: "Scheduler"
    runner: "ModelRunner"

    def drain(self) -> list: ...

    def abort_all(self, message: str) -> list: ...


class GenerationControl:
    def __init__(self, core: ControlledCore) -> None:
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
        if isinstance(msg, ReleaseMemoryReq):
            return self._release(check_memory_tags(msg.tags))
        if isinstance(msg, ResumeMemoryReq):
            return self._resume(check_memory_tags(msg.tags))
        raise TypeError(f"unknown control message {type(msg).__name__}")

    def _release(self, tags: list[str]) -> Reply:
        """Generation stops while anything is released (requests wait in the queue); the KV it
        held is stale afterwards, so running requests are retracted and the cache flushed."""
        core = self.core
        outputs = core.drain()
        if "kv_cache" in tags:
            core.scheduler.retract_all()
            core.scheduler.flush_cache()
        core.runner.release_memory(tags)
        core.memory_released.update(tags)
        return Reply((True, f"released {', '.join(tags)}"), outputs)

    def _resume(self, tags: list[str]) -> Reply:
        core = self.core
        core.runner.resume_memory(tags)
        core.memory_released.difference_update(tags)
        return Reply((True, f"resumed {', '.join(tags)}"))

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
        from weight_sync.base import LoadContext

        core = self.core
        if "weights" in core.memory_released:
            raise ValueError("weights are released: call resume_memory_occupation(tags=['weights']) first")
        msg.source.load_into(core.runner.model, LoadContext(core.runner.device, self.groups))
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
