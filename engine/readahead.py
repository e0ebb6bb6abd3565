"""Readahead: the large shared libraries of a start-up read into the page cache before they are needed.

On a fresh machine nothing is in the page cache, and `tandem serve` (8B shape, H100) took 25-32 s
to ready against 14-16 s on the same machine warm (docs/benchmarks.md): importing torch, CUDA's
lazy kernel loading and Triton's first compiles (libtriton, ptxas) fault their shared objects in
a page run at a time, one fault after another. A few threads reading the same files in large
blocks from the first moment keep many reads in flight instead; what the start-up then touches is
already cached. The files are found without importing their packages (importlib specs), in the
order a start-up needs them: torch's libraries, CUDA's (the `nvidia` wheels), Triton's compiler.
Nothing stays in this process's memory but one buffer a thread.

TANDEM_READAHEAD: 1 reads ahead, 0 does not (the default until a fresh machine measures it).
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from engine.kernels import env_choice

logger = logging.getLogger(__name__)

ENV = "TANDEM_READAHEAD"
READERS = 4  # reads in flight: enough to keep a network disk busy, few enough to leave the CPU alone
CHUNK = 64 << 20  # a large file is read by several threads at once, in order
BUFFER = 4 << 20
# (package, its folders holding what a start-up maps), in the order a start-up maps them
SOURCES = (("torch", ("lib",)), ("nvidia", ("",)), ("triton", ("_C", "backends/nvidia")))
# the C compiler Triton builds each kernel's launcher with (its first launch of a signature)
COMPILER_GLOBS = ("/usr/lib/gcc/*/*/cc1", "/usr/libexec/gcc/*/*/cc1")
# present in the wheels, never loaded by a start-up: dense convolution engines, FFT, solvers
SKIP = ("cudnn_engines", "cudnn_adv", "cudnn_cnn", "cufft", "cusolver", "cusparseLt", "nvshmem", "cupti")


def wanted() -> bool:
    return env_choice(ENV, "0", ("0", "1"), "1 (read the start-up's libraries ahead) or 0") == "1"


def library_files(sources=SOURCES, skip=SKIP, compiler_globs=COMPILER_GLOBS) -> list[Path]:
    """The shared objects and compiler binaries under each source package, in `sources` order,
    then the C compiler."""
    files: dict[Path, None] = {}  # by real path: a library's symlinked names once
    for package, folders in sources:
        for root in _package_dirs(package):
            for folder in folders:
                for path in sorted((root / folder).rglob("*")):
                    if _is_library(path, skip):
                        files.setdefault(path.resolve())
    for pattern in compiler_globs:
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            files.setdefault(path.resolve())
    return list(files)


def start(files: Optional[Iterable[Path]] = None, readers: int = READERS) -> Optional[threading.Thread]:
    """Lists `files` (library_files() by default) and reads them on daemon threads, returning at
    once the thread that does it, or None when TANDEM_READAHEAD is not 1. Never raises for a file
    it cannot list or read: the start-up says so itself if it needs that file."""
    if not wanted():
        return None
    thread = threading.Thread(target=_read_ahead, args=(files, readers), name="readahead", daemon=True)
    thread.start()
    return thread


def _read_ahead(files: Optional[Iterable[Path]], readers: int) -> None:
    started = time.perf_counter()
    chunks: "queue.Queue[Optional[tuple[Path, int, int]]]" = queue.Queue()
    threads = [threading.Thread(target=_read_chunks, args=(chunks,), name=f"readahead-{i}", daemon=True)
               for i in range(readers)]
    for thread in threads:
        thread.start()
    queued = _queue_chunks(lambda: library_files() if files is None else files, chunks, _page_cache_budget())
    for _ in threads:
        chunks.put(None)
    for thread in threads:
        thread.join()
    logger.info("read %.2f GB of libraries ahead in %.1f s", queued / 1e9, time.perf_counter() - started)


def _queue_chunks(listing: Callable[[], Iterable[Path]], chunks: "queue.Queue", budget: float) -> int:
    """Each listed file's chunks in order, until the next file would pass `budget` bytes; the
    bytes queued. A folder it may not list ends the listing: what was queued is read."""
    total = 0
    try:
        for path in listing():
            size = _size(path)
            if total + size > budget:  # a small machine: what is read first would be evicted by the rest
                break
            for offset in range(0, size, CHUNK):
                chunks.put((path, offset, min(CHUNK, size - offset)))
            total += size
    except OSError as exc:
        logger.debug("readahead stopped listing: %s", exc)
    return total


def _read_chunks(chunks: "queue.Queue") -> None:
    buffer = memoryview(bytearray(BUFFER))
    while (item := chunks.get()) is not None:
        path, offset, length = item
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                while length > 0 and (n := f.readinto(buffer[:min(BUFFER, length)])):
                    length -= n
        except OSError:  # gone or unreadable: the start-up will say so itself if it needs it
            continue


def _package_dirs(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _is_library(path: Path, skip: tuple[str, ...]) -> bool:
    name = path.name
    if any(part in name for part in skip):
        return False
    if not (name.endswith(".so") or ".so." in name or path.parent.name == "bin"):
        return False
    try:
        return path.is_file()
    except OSError:  # a link into a folder this user may not read
        return False


def _page_cache_budget(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> float:
    """Half the memory this process may still fill: the kernel's MemAvailable, or its container's
    memory.max less memory.current where that is less (page cache counts against it)."""
    available = float("inf")
    try:
        with open(meminfo) as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int(Path(cgroup, "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available / 2


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
