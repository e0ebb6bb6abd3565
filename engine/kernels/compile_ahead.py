"""CompileAhead: a pass's Triton kernels compiled on a thread pool, not one by one at first launch.

`tandem serve` (8B) on a fresh machine spent 28.3 s in its runner phase (CUDA graphs) against 9.6 s
with a warm Triton cache (issue 25's time to ready): the difference is kernels compiling, each when
first launched, one after another, while most of a compile (MLIR passes, LLVM, ptxas) runs without
the GIL. Threads compile side by side (on a 2-core CPU: 8 compiles in 0.61 s vs 1.06 s serially; an
H100's host, the 8B's 33 kernels: 16.6 s on 1 thread, 6.8 s on 4, 5.1 s on 16; TANDEM_COMPILE_WORKERS).

`dry_pass()` runs a pass with Triton's own hooks set for this thread:
- `knobs.runtime.jit_cache_hook` (called before a kernel not yet compiled here would compile)
  hands the specialization to the pool and answers "skip": no compile here and no launch;
- `knobs.runtime.launch_enter_hook` (called just before a launch) raises `DryLaunch`: a kernel
  compiled earlier in this process would otherwise launch on the dry pass's unwritten buffers.
  That ends that call of `run` there (it answers False); what was handed over still compiles.
The pool compiles into Triton's on-disk cache only (never the in-memory one, so nothing becomes
launchable during the pass), and builds each kernel's launcher there too (Triton 3.6 compiles a C
launcher per kernel signature with gcc at its first launch); the real pass that follows loads both
from that cache. One dry pass at a time per process (the hooks are process-wide).

On by default where it pays, a fresh machine: `TANDEM_COMPILE_AHEAD=auto` compiles ahead unless a
marker in Triton's cache dir says these graphs' kernels were compiled there before (`graphs_marker`:
the kernels' sources, Triton's version, the device and the capture's shape). Measured on an H100
(8B shape, 35 graphs, empty caches): ready in 19.3 s -> 15.3 s; with a warm cache the dry pass only
costs (11.6 -> 13.2 s), which the marker skips. 1 always, 0 never.

A dry pass's Triton outputs are never written: only passes whose device work is Triton kernels
and torch ops that read no index a skipped kernel produced may run dry (the decode forward with
the Triton attention backend; not flashinfer, whose kernels would read skipped indices).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from engine.kernels import env_choice

logger = logging.getLogger(__name__)

ENV = "TANDEM_COMPILE_AHEAD"  # compile the decode graphs' kernels on a pool before capture: auto | 1 | 0
MAX_WORKERS = 16  # each compile holds LLVM and ptxas (hundreds of MB): not one per core of a big host
WORKERS_ENV = "TANDEM_COMPILE_WORKERS"  # the pool's threads (default: the usable CPUs, at most 16)
_ONE_PASS = threading.Lock()
_KERNEL_DIR = Path(__file__).resolve().parent  # every Triton kernel of the engine lives below it
# the engine's switches that choose the graphs' kernels (not how start-up runs: those would only
# make a start with them set miss the marker a default start wrote)
KERNEL_SWITCHES = ("TANDEM_PDL", "TANDEM_SMALL_M_EPILOGUE", "TANDEM_DISABLE_SMALL_M_LINEAR", "TANDEM_DISABLE_FUSED_KV_STORE",
                   "TANDEM_DISABLE_FUSED_GREEDY", "TANDEM_TABLE_OUTSIDE_GRAPH", "TANDEM_DET_GEMV", "TANDEM_GEMV_PREFETCH",
                   "TANDEM_GEMV_MAX_M", "TANDEM_DET_GEMV_MAX_M", "TANDEM_QK_ROWS",
                   "TANDEM_GRAPH_LOGITS", "TANDEM_PHASE_A_PROGRAMS")


def compile_ahead_mode() -> str:
    """TANDEM_COMPILE_AHEAD: auto, 1 or 0."""
    return env_choice(ENV, "auto", ("0", "1", "auto"),
                      "auto (where no earlier start compiled these kernels), 1 (always) or 0 (never)")


def compile_ahead_wanted(marker: Optional[Path]) -> bool:
    """Whether to compile ahead: TANDEM_COMPILE_AHEAD, and under auto whether `marker` is missing."""
    mode = compile_ahead_mode()
    if mode == "auto":
        return marker is not None and not marker.exists()
    return mode == "1"


def graphs_marker(shape: dict) -> Optional[Path]:
    """The file in Triton's cache dir saying the kernels of graphs of this `shape` (JSON-able: the
    model's dims, the capture sizes, dtype...) were compiled there: named by a hash of the shape,
    Triton's version, the device, the switches choosing kernels and every kernel source. None
    without Triton."""
    try:
        import triton
        from triton import knobs
        import torch

        cache_dir = Path(knobs.cache.dir)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # an older Triton without knobs: compile ahead only when asked
        return None
    switches = [(name, os.environ.get(name)) for name in KERNEL_SWITCHES]
    digest = hashlib.sha256(json.dumps([shape, triton.__version__, device, switches],
                                       sort_keys=True, default=str).encode())
    for source in sorted(_KERNEL_DIR.rglob("*.py")):  # ~30 small files: ~1 ms a start
        digest.update(source.read_bytes())
    return cache_dir / f"tandem-graphs-{digest.hexdigest()[:24]}"


def mark_compiled(marker: Optional[Path]) -> None:
    """After the captures: the next start here finds these kernels in Triton's cache."""
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # a read-only cache: the next start compiles ahead again, no harm
        logger.debug("could not write %s", marker, exc_info=True)


class DryLaunch(Exception):
    """A compiled kernel was about to launch during a dry pass."""


@dataclass
class CompileReport:
    submitted: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


class CompileAhead:
    def __init__(self, workers: Optional[int] = None) -> None:
        self._pool = ThreadPoolExecutor(workers or _pool_size(), thread_name_prefix="triton-compile")
        self._futures: dict[Any, tuple[str, Future]] = {}
        self._thread: Optional[int] = None  # the dry pass's thread; other threads see the hooks unset
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def dry_pass(self) -> Iterator["CompileAhead"]:
        from triton import knobs

        runtime = knobs.runtime
        launch_hooks = runtime.launch_enter_hook  # a HookChain (Triton >= 3.4): every launch calls it
        if not isinstance(getattr(launch_hooks, "calls", None), list):
            raise RuntimeError(f"this Triton ({triton_version()}) has no chain of launch hooks to stop a "
                               "dry pass's launches: compiling ahead needs Triton 3.4 or later")
        with _ONE_PASS:
            saved_compile_hook = runtime.jit_cache_hook
            self._thread = threading.get_ident()
            runtime.jit_cache_hook = self._chain(self._on_compile, saved_compile_hook)
            launch_hooks.calls.insert(0, self._on_launch)  # first: a hook after it would see no launch
            try:
                yield self
            finally:
                launch_hooks.calls.remove(self._on_launch)
                runtime.jit_cache_hook = saved_compile_hook
                self._thread = None

    def run(self, fn: Callable[[], Any]) -> bool:
        """fn() inside dry_pass(); False when it reached a kernel compiled before (stop there)."""
        try:
            fn()
        except DryLaunch:
            return False
        return True

    def wait(self) -> CompileReport:
        """Every handed-over compile finished (a failed one compiles again, and fails there, at its
        first real launch)."""
        report = CompileReport(submitted=len(self._futures))
        for name, future in self._futures.values():
            if future.exception() is not None:
                report.failed.append(f"{name}: {future.exception()}")
        self._pool.shutdown()
        report.seconds = time.perf_counter() - self._start
        return report

    # ---- Triton's hooks --------------------------------------------------------------------------
    def _chain(self, ours: Callable, theirs: Optional[Callable]) -> Callable:
        def hook(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                return ours(*args, **kwargs)
            return theirs(*args, **kwargs) if theirs is not None else None
        return hook

    def _on_launch(self, metadata: Any) -> None:
        if threading.get_ident() == self._thread:
            raise DryLaunch()

    def _on_compile(self, *, key: Any, fn: Any, compile: dict, **_: Any) -> bool:
        jit_fn = fn.jit_function
        ident = (id(jit_fn), key)
        if ident not in self._futures:
            _, _, target, backend, _ = jit_fn.device_caches[compile["device"]]
            options = json.loads(compile["specialization_data"])["options"]
            options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
            task = (jit_fn, compile["signature"], compile["constants"], compile["configs"][0], target, options)
            self._futures[ident] = (fn.name, self._pool.submit(_compile_to_disk, *task))
        return True  # skip: neither compiled nor launched here


def triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "unknown")


def _pool_size() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))  # a container's share, not the host's cores
    except AttributeError:
        cpus = os.cpu_count() or 1
    asked = os.environ.get(WORKERS_ENV, "").strip()
    if not asked:
        return max(1, min(cpus, MAX_WORKERS))
    try:
        workers = int(asked)
    except ValueError:
        workers = 0
    if workers < 1:
        raise ValueError(f"{WORKERS_ENV}={asked!r}: give a number of threads, 1 or more (or leave it unset)")
    return workers


def _compile_to_disk(jit_fn: Any, signature: dict, constants: dict, attrs: dict, target: Any, options: Any) -> Any:
    """What JITFunction._do_compile compiles, the same cache key, without its in-memory cache; then
    the launcher its first launch would build."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime import driver

    kernel = triton.compile(ASTSource(jit_fn, signature, constants, attrs), target=target, options=options.__dict__)
    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)  # cached on disk by its source
    except Exception:  # best effort: the first launch builds it (and says what is wrong) otherwise
        logger.debug("no launcher built ahead for %s", getattr(jit_fn, "__name__", jit_fn), exc_info=True)
    return kernel
