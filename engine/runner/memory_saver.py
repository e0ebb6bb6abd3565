"""MemorySaver: the engine's GPU memory in tagged regions that can be freed and brought back.

For a trainer colocated on the same GPU. Built on torch-memory-saver in its "torch" hook mode
(a CUDA pluggable allocator: no LD_PRELOAD, so it works inside Ray actors): tensors allocated
inside `region(tag)` get virtual addresses whose physical memory `pause(tag)` unmaps and
`resume(tag)` maps again at the same addresses, in milliseconds.

Tags (SGLang's): "weights" (the model, loaded inside the region), "kv_cache" (the KV pool),
"cuda_graph". The weights' contents are lost on release unless `weights_cpu_backup` (SGLang's
enable_weights_cpu_backup) keeps a host copy; by default the next weight update rewrites them
(the colocated flow: release -> train -> resume weights -> push -> resume kv_cache). The KV
pool's contents are always lost (the core flushes the cache first). CUDA graphs cannot be
captured into a torch-mode region, so "cuda_graph" is released by dropping the graphs (their
memory pool, static inputs and logits buffer) and resumed by capturing them again: their weights
and KV addresses are unchanged, so the new graphs are the old ones.

Off the GPU, or with the saver off (SGLang's default), regions are plain allocations and
pause/resume free nothing: the engine still stops and resumes generation around them.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)
REGION_TAGS = ("weights", "kv_cache")  # allocated in torch-memory-saver regions
_ENGINE_IDS = itertools.count()


class MemorySaver:
    def __init__(self, enabled: bool, device: torch.device, weights_cpu_backup: bool = False) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.weights_cpu_backup = weights_cpu_backup
        self.paused: set[str] = set()
        self._tms: Any = None
        # the allocator's tags are process-wide: two engines in one process keep theirs apart
        self._suffix = f"@tandem{next(_ENGINE_IDS)}"
        if enabled and device.type != "cuda":
            logger.info("enable_memory_saver has no effect on %s: nothing is allocated on a GPU", device.type)
        if self.enabled:
            self._tms = _new_saver()
            self.allow_frees()

    def allow_frees(self) -> None:
        """torch-memory-saver's torch-mode free ends the process ("only support interesting
        region") unless the calling thread is inside a region, yet its pools are freed outside
        regions too: a re-captured graph's empty_cache, an engine's tensors dying, the pools'
        teardown at exit. In torch mode nothing else reads that per-thread flag (allocations go
        to a pool only inside region()), so threads that may free keep it set."""
        if self.enabled:
            _set_free_allowed(self._tms)

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        """Allocations inside belong to `tag` (a no-op context when the saver is off)."""
        if not self.enabled:
            return contextlib.nullcontext()
        self.allow_frees()
        if tag not in REGION_TAGS:
            raise ValueError(f"no memory region for tag {tag!r}; regions are {', '.join(REGION_TAGS)}")
        backup = tag == "weights" and self.weights_cpu_backup
        return self._tms.region(tag=tag + self._suffix, enable_cpu_backup=backup)

    def pause(self, tag: str) -> None:
        self.allow_frees()
        if self.enabled and tag in REGION_TAGS and tag not in self.paused:
            self._tms.pause(tag + self._suffix)
        self.paused.add(tag)

    def resume(self, tag: str) -> None:
        self.allow_frees()
        if self.enabled and tag in REGION_TAGS and tag in self.paused:
            self._tms.resume(tag + self._suffix)
        self.paused.discard(tag)

    def resume_all(self) -> None:
        for tag in list(self.paused):
            self.resume(tag)


def _new_saver() -> Any:
    try:
        from torch_memory_saver import TorchMemorySaver
    except ImportError as exc:
        raise RuntimeError("enable_memory_saver needs torch-memory-saver on the GPU machine: "
                           "pip install torch-memory-saver (or start without --enable-memory-saver)") from exc
    saver = TorchMemorySaver()  # our own instance: its hook mode is ours to choose before first use
    saver.hook_mode = "torch"
    atexit.register(_set_free_allowed, saver)  # the pools are torn down on the main thread at exit
    return saver


def _set_free_allowed(saver: Any) -> None:
    try:
        saver._ensure_initialized()  # noqa: SLF001 (no public setter for the flag)
        saver._impl._binary_wrapper.cdll.tms_set_interesting_region(True)  # noqa: SLF001
    except AttributeError:
        logger.warning("torch-memory-saver changed its internals: frees outside a region may end the process")
