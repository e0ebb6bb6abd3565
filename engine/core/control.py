"""GenerationControl: pause / continue generation and weight updates, run between steps.

Every message here runs on the core thread between two steps, after the launched (overlap) batch
is finished, so no forward pass ever sees half-loaded weights and every token is attributed to
the weights that produced it. The RL protocol (DESIGN section 5) is the caller's sequence:
pause (abort | retract | in_place) -> update weights (tensors or a checkpoint; names, shapes,
castable dtypes and completeness are checked before any parameter is written) -> flush the radix
cache (its KV is stale) -> new weight_version -> continue. Semantics and messages follow SGLang's
(shared/reference/sglang-rl-api.md 1.1, 1.2, 1.5, 1.6, 1.9): an update that flushes while not
paused waits for the running requests to end, new ones waiting behind it (`must_wait`; CoreWorker
holds it), and one that cannot flush (in_place keeps running requests' KV) is refused before
writing, so the reply and the weights agree. Broadcast groups form off the core loop
(engine/core/weight_groups.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

from engine.core.messages import (ContinueReq, DestroyWeightsGroupReq, InitWeightsGroupReq, PauseReq, ReleaseMemoryReq,
                                  Reply, ResumeMemoryReq, SetWeightVersionReq, UpdateWeightsReq, WeightsGroupStatusReq,
                                  check_memory_tags, check_pause_mode)
from engine.core.weight_groups import WeightGroups
from engine.models.weight_cast import WeightsPartlyWritten
from engine.phase_clock import PhaseClock

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


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
        self.groups = WeightGroups()  # broadcast groups, formed off the core loop
        self.num_updates = 0  # successful loads (a bucket each), for /metrics
        self.update_seconds = 0.0  # time in them: receive + load + flush
        self._told_waiting = False  # a request's wait on released memory logged since the release

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
        tp = self.core.runner.tp  # tensor parallelism: rank t joins a trainer's group as rank_offset + t
        if isinstance(msg, InitWeightsGroupReq):
            refusal = self.groups.start(msg)
            if refusal is None and tp is not None:
                tp.init_weights_group(msg)
            return Reply(refusal)
        if isinstance(msg, WeightsGroupStatusReq):
            return Reply(self.groups.status(msg.group_name))
        if isinstance(msg, DestroyWeightsGroupReq):
            if tp is not None:
                tp.destroy_weights_group(msg.group_name)
            return Reply(self.groups.destroy(msg.group_name))
        if isinstance(msg, ReleaseMemoryReq):
            return self._release(check_memory_tags(msg.tags))
        if isinstance(msg, ResumeMemoryReq):
            return self._resume(check_memory_tags(msg.tags))
        raise TypeError(f"unknown control message {type(msg).__name__}")

    def _release(self, tags: list[str]) -> Reply:
        """Generation stops while anything is released (requests wait in the queue); the KV it
        held is stale afterwards, so running requests are retracted and the cache flushed."""
        core, clock = self.core, PhaseClock()
        with clock.phase("drain"):
            outputs = core.drain()
        if "kv_cache" in tags:
            with clock.phase("retract"):
                core.scheduler.retract_all()
                core.scheduler.flush_cache()
        core.runner.release_memory(tags, clock)
        core.memory_released.update(tags)
        logger.info("released %s in %.3f s (%s)", ",".join(tags), clock.elapsed(), clock.breakdown(3))
        return Reply((True, f"released {', '.join(tags)}"), outputs)

    def note_request_while_released(self, rid: str) -> None:
        """Once per release: a request arrived that waits until everything is resumed (said in
        the log, or a client that forgot the resume would see only a request that never ends)."""
        if not self._told_waiting:
            self._told_waiting = True
            logger.warning("request %s waits: %s released; resume_memory_occupation() lets it run", rid,
                           ", ".join(sorted(self.core.memory_released)))

    def _resume(self, tags: list[str]) -> Reply:
        core, clock = self.core, PhaseClock()
        core.runner.resume_memory(tags, clock)
        core.memory_released.difference_update(tags)
        self._told_waiting = self._told_waiting and bool(core.memory_released)
        logger.info("resumed %s in %.3f s (%s)", ",".join(tags), clock.elapsed(), clock.breakdown(3))
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

    def must_wait(self, msg: UpdateWeightsReq, cutoff: int) -> bool:
        """SGLang's unpaused update (its writer lock): it waits until every request queued before
        it (number < `cutoff`) has ended, all their tokens the old weights'; later ones wait for it
        (Admission.admit_before). Not while generation is stopped (paused, memory released: those
        requests could not end; it runs at once and is refused if their KV cannot be flushed), not
        with flush_cache=False (it lands between two steps), and never a broadcast: the trainer
        sends it alongside the call and the group's timeout would expire (refused, as before)."""
        core = self.core
        return (msg.flush_cache and core.generating and getattr(msg.source, "discard", None) is None
                and core.scheduler.num_in_flight_before(cutoff) > 0)

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
        except WeightsPartlyWritten as exc:  # every check passed, then a write failed
            logger.exception("weight update failed while writing")
            value = (False, f"Weight update failed (weights may be partly written; load a full checkpoint to "
                            f"recover): {exc}")
        except (ValueError, OSError) as exc:  # names, shapes, dtypes, completeness: checked before writing
            value = (False, f"Weights not updated: {exc}")
        except Exception as exc:  # e.g. a corrupt file or a failed copy: still answered
            logger.exception("weight update failed")
            value = (False, f"Weight update failed (weights may be partly written): {type(exc).__name__}: {exc}")
        return Reply(value, outputs)

    def _load(self, msg: UpdateWeightsReq) -> tuple[bool, str]:
        from engine.models.loader import load_safetensors
        from weight_sync.base import LoadContext

        core = self.core
        ctx = LoadContext(core.runner.device, self.groups.formed, load_checkpoint=load_safetensors)
        refusal = self._refusal(msg)
        if refusal is not None:  # before any write; a broadcast is still received, to stay in step
            discard = getattr(msg.source, "discard", None)
            if discard is not None and core.runner.tp is not None:  # the trainer's broadcast reaches every rank
                core.runner.tp.discard(msg.source, ctx)
            elif discard is not None:
                discard(ctx)
            raise ValueError(refusal)
        if core.runner.tp is not None:  # every tensor-parallel rank loads its shards of the same tensors
            core.runner.tp.load_weights(msg.source, core.runner.model, ctx)
        else:
            msg.source.load_into(core.runner.model, ctx)
        message = "Success."
        if msg.weight_version is not None:  # the version names the weights now loaded
            core.weight_version = str(msg.weight_version)
            message += f" Weight version updated to {core.weight_version}."
        message = msg.source.success_message or message
        if msg.flush_cache:
            core.scheduler.flush_cache()  # cannot fail: _refusal saw that nothing holds KV
        return True, message

    def _refusal(self, msg: UpdateWeightsReq) -> Optional[str]:
        """Why the update cannot succeed as asked, known before writing (reply and state agree)."""
        core = self.core
        if "weights" in core.memory_released:
            return "weights are released: call resume_memory_occupation(tags=['weights']) first"
        holding = core.scheduler.num_holding_kv()
        if msg.flush_cache and holding:
            return (f"flush_cache=True, but {holding} request(s) still hold KV cache (paused in_place), so the "
                    f"stale cache cannot be flushed; pass flush_cache=False to keep their KV "
                    f"(stale under the new weights, as SGLang's in_place), or pause with mode='retract' or "
                    f"'abort' first")
        return None
