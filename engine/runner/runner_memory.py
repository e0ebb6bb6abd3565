"""RunnerMemory: the ModelRunner's colocated memory release and resume (a mixin, as Engine's
EngineWeights): weights, KV and the CUDA graphs' pool unmapped and mapped back at the same
addresses through the runner's MemorySaver (engine/runner/memory_saver.py), so the graphs captured
at start-up replay as they are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from engine.phase_clock import PhaseClock

if TYPE_CHECKING:
    from engine.runner.memory_saver import MemorySaver

logger = logging.getLogger(__name__)


class RunnerMemory:
    """Reads the runner's memory_saver, device, model, req_to_token(_pool) and kv_pool."""

    memory_saver: "MemorySaver"
    _buffers_backup: dict

    def release_memory(self, tags: list[str], clock: Optional[PhaseClock] = None) -> None:
        """Free the GPU memory of `tags`. The core has drained the launched batch (and, for
        kv_cache, retracted every request and flushed the cache) and runs nothing until resumed."""
        saver, clock = self.memory_saver, clock or PhaseClock()
        saver.allow_frees()  # empty_cache below may return the saver's blocks from this thread
        if not saver.enabled:
            logger.info("release_memory_occupation(%s): nothing freed (%s)", ",".join(tags), self._why_no_op())
            saver.paused.update(tags)
            return
        with clock.phase("sync"):
            if self.device.type == "cuda":  # (a test's saver fakes the GPU)
                torch.cuda.synchronize(self.device)
        if "weights" in tags and "weights" not in saver.paused:
            with clock.phase("buffers"):  # rotary inv_freq: in the weights region, but no update rewrites it
                self._buffers_backup = {name: buf.to("cpu", copy=True) for name, buf in self.model.named_buffers()}
        with clock.phase("empty_cache"):
            torch.cuda.empty_cache()  # cached activations back to the driver, before any pause
        for tag in tags:
            with clock.phase(f"unmap {tag}"):
                saver.pause(tag)

    def resume_memory(self, tags: list[str], clock: Optional[PhaseClock] = None) -> None:
        """Bring `tags` back (weights, KV and the graphs' pool at their old addresses: the graphs
        captured at start-up replay as they are)."""
        saver, clock = self.memory_saver, clock or PhaseClock()
        if not saver.enabled:
            logger.info("resume_memory_occupation(%s): nothing to restore (%s)", ",".join(tags), self._why_no_op())
            saver.paused.difference_update(tags)
            return
        back = [tag for tag in ("weights", "kv_cache", "cuda_graph") if tag in tags and tag in saver.paused]
        for tag in back:  # weights first, KV last (SGLang's order)
            with clock.phase(f"map {tag}"):
                saver.resume(tag)
        with clock.phase("reset"):
            if "kv_cache" in back and self.req_to_token is not self.req_to_token_pool.req_to_token:
                self.req_to_token.zero_()  # graph padding rows read row 0: valid slot indices again
            if "kv_cache" in back and self.kv_pool.routed_experts is not None:
                self.kv_pool.routed_experts.fill_(-1)  # the region returns undefined; dense layers read -1
            if "weights" in back:
                self._restore_buffers()
        if "weights" in back and not saver.weights_cpu_backup:
            logger.info("weights resumed without a CPU backup: their values are undefined until the next "
                        "weight update (update_weights_from_tensor / _disk / _distributed)")

    def _restore_buffers(self) -> None:
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, saved in self._buffers_backup.items():
                buffers[name].copy_(saved)
        self._buffers_backup = {}

    def _why_no_op(self) -> str:
        if self.device.type != "cuda":
            return f"a no-op on {self.device.type}"
        return "the memory saver is off: start the engine with enable_memory_saver=True to free GPU memory"
