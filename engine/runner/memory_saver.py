"""MemorySaver: the engine's GPU memory in tagged regions that can be freed and brought back.

For a trainer colocated on the same GPU. Built on torch-memory-saver in its "torch" hook mode
(a CUDA pluggable allocator: no LD_PRELOAD, so it works inside Ray actors): tensors allocated
inside `region(tag)` get virtual addresses whose physical memory `pause(tag)` unmaps and
`resume(tag)` maps again at the same addresses, in milliseconds.

Tags (SGLang's): "weights" (the model, loaded inside the region), "kv_cache" (the KV pool),
"cuda_graph" (the memory pool the CUDA graphs are captured into). The weights' contents are lost
on release unless `weights_cpu_backup` (SGLang's enable_weights_cpu_backup) keeps a host copy; by
default the next weight update rewrites them (the colocated flow: release -> train -> resume
weights -> push -> resume kv_cache). The KV pool's contents are always lost (the core flushes the
cache first). The graphs' pool holds only what a replay writes before it reads (activations), so
its contents need no backup either: the graphs survive a release and replay on memory mapped back
at the same addresses, with no re-capture (SGLang gets the same from torch-memory-saver's
LD_PRELOAD mode; in torch mode the pool is a MemPool on the saver's allocator, the capture
running under the region's tag).

Off the GPU, or with the saver off (SGLang's default), regions are plain allocations and
pause/resume free nothing: the engine still stops and resumes generation around them.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)
REGION_TAGS = ("weights", "kv_cache", "cuda_graph")  # torch-memory-saver regions
ALLOCATION_TAGS = ("weights", "kv_cache")  # region(): the graphs' pool is made by graph_pool()
_ENGINE_IDS = itertools.count()


class MemorySaver:
    def __init__(self, enabled: bool, device: torch.device, weights_cpu_backup: bool = False) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.weights_cpu_backup = weights_cpu_backup
        self.paused: set[str] = set()
        self._tms: Any = None
        # the allocator's tags are process-wide: two engines in one process keep theirs apart
        self._suffix = f"@tandem{next(_ENGINE_IDS)}"
        self._graph_pool: Any = None  # the "cuda_graph" region's MemPool, made at the first capture
        if enabled and device.type != "cuda":
            logger.info("enable_memory_saver has no effect on %s: nothing is allocated on a GPU", device.type)
        if self.enabled:
            self._tms = _new_saver()
            self.allow_frees()

    def allow_frees(self) -> None:
        """torch-memory-saver's torch-mode free ends the process ("only support interesting
        region") unless the calling thread is inside a region, yet its pools are freed outside
        regions too: an empty_cache, an engine's tensors dying, the pools'
        teardown at exit. In torch mode nothing else reads that per-thread flag (allocations go
        to a pool only inside region()), so threads that may free keep it set."""
        if self.enabled:
            _set_free_allowed(self._tms)

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        """Allocations inside belong to `tag` (a no-op context when the saver is off)."""
        if not self.enabled:
            return contextlib.nullcontext()
        self.allow_frees()
        if tag not in ALLOCATION_TAGS:
            raise ValueError(f"no memory region for tag {tag!r}; regions are {', '.join(ALLOCATION_TAGS)}")
        backup = tag == "weights" and self.weights_cpu_backup
        return self._tms.region(tag=tag + self._suffix, enable_cpu_backup=backup)

    def graph_pool(self) -> Optional[tuple[Any, Callable[[], contextlib.AbstractContextManager]]]:
        """-> (the pool id CUDA graphs are captured into, the context each capture runs in): the
        "cuda_graph" region, which pause("cuda_graph") unmaps and resume maps back at the same
        addresses. None with the saver off: the graph runner's own private pool."""
        if not self.enabled:
            return None
        self.allow_frees()
        impl = self._tms._impl  # noqa: SLF001 (torch mode has no public pauseable-graph API)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.MemPool(allocator=impl._hook_util.get_allocator())  # noqa: SLF001
        tag = "cuda_graph" + self._suffix
        return self._graph_pool.id, lambda: impl._with_region_config(  # noqa: SLF001
            tag=tag, enable_cpu_backup=False, cpu_backup_backend=None)

    def drop_graph_pool(self) -> None:
        """Frees the graphs' pool (their graphs gone first) on the calling thread, which then may
        free into the region: torch mode ends the process on a free from any other thread."""
        if self._graph_pool is not None:
            self.allow_frees()
            self._graph_pool = None
            torch.cuda.empty_cache()

    def pause(self, tag: str) -> None:
        self.allow_frees()
        if self.enabled and self._has_region(tag) and tag not in self.paused:
            self._tms.pause(tag + self._suffix)
        self.paused.add(tag)

    def resume(self, tag: str) -> None:
        self.allow_frees()
        if self.enabled and self._has_region(tag) and tag in self.paused:
            self._tms.resume(tag + self._suffix)
        self.paused.discard(tag)

    def _has_region(self, tag: str) -> bool:
        """An eager engine (no CUDA graphs) has no graphs' pool to unmap."""
        return tag in REGION_TAGS and (tag != "cuda_graph" or self._graph_pool is not None)

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
