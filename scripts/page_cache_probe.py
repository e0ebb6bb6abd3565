"""Which of a start-up's libraries are in the page cache, and how much of each.

Run after a start on a fresh machine: the resident bytes of every shared object under torch, the
`nvidia` wheels and Triton say what a start-up reads. (Reading those ahead on threads from serve's
first moment did not shorten a cold start: docs/benchmarks.md.)
--evict drops those files and the Python packages' own files from the page cache instead
(POSIX_FADV_DONTNEED; no root needed), so the next start reads them from the disk again.

    python scripts/page_cache_probe.py [--top 40] [--evict]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import mmap
import os
from pathlib import Path

# (package, its folders holding the shared objects and binaries a start-up maps)
LIBRARY_SOURCES = (("torch", ("lib",)), ("nvidia", ("",)), ("triton", ("_C", "backends/nvidia")))
# the C compiler Triton builds each kernel's launcher with (its first launch of a signature)
COMPILER_GLOBS = ("/usr/lib/gcc/*/*/cc1", "/usr/libexec/gcc/*/*/cc1")
PACKAGES = ("torch", "nvidia", "triton", "transformers", "fastapi", "pydantic", "numpy", "safetensors", "uvicorn")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a read-only mapping; nothing is read); -1
    where mincore cannot tell (Linux answers "all cached" for a file the caller neither owns nor
    may write) or the file cannot be opened."""
    stat = path.stat()
    if stat.st_size == 0:
        return 0
    if os.geteuid() not in (0, stat.st_uid) and not os.access(path, os.W_OK):
        return -1
    size = stat.st_size
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return -1
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(v & 1 for v in bytes(vec)) * mmap.PAGESIZE
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def library_files() -> list[Path]:
    """The shared objects and compiler binaries of LIBRARY_SOURCES, then the C compiler."""
    files: dict[Path, None] = {}  # by real path: a library's symlinked names once
    for package, folders in LIBRARY_SOURCES:
        for root in _package_dirs(package):
            for folder in folders:
                for path in sorted((root / folder).rglob("*")):
                    if _is_library(path):
                        files.setdefault(path.resolve())
    for pattern in COMPILER_GLOBS:
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            files.setdefault(path.resolve())
    return list(files)


def _package_dirs(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)  # found, not imported
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _is_library(path: Path) -> bool:
    if not (path.name.endswith(".so") or ".so." in path.name or path.parent.name == "bin"):
        return False
    try:
        return path.is_file()
    except OSError:  # a link into a folder this user may not read
        return False


def package_files(packages=PACKAGES) -> list[Path]:
    files = []
    for package in packages:
        for root in _package_dirs(package):
            files += [p.resolve() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return list(dict.fromkeys(files))


def evict_start_files() -> int:
    """Every file of PACKAGES and the C compiler out of the page cache; how many were dropped."""
    return evict(list(dict.fromkeys(package_files() + library_files())))


def evict(files: list[Path]) -> int:
    dropped = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        finally:
            os.close(fd)
    return dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--evict", action="store_true")
    args = p.parse_args()
    if args.evict:
        print(f"evicted {evict_start_files()} files of {', '.join(PACKAGES)} and the C compiler")
        return
    every = library_files()
    libraries = set(every)
    rows = sorted(((resident_bytes(f), f.stat().st_size, f) for f in every), key=lambda r: -r[0])
    if any(r[0] < 0 for r in rows):
        print("(-1: not known; run as the files' owner or root)")
    print(f"{'resident MB':>11s} {'size MB':>8s} {'%':>4s}  file")
    for resident, size, path in rows[:args.top]:
        print(f"{resident / 1e6:11.1f} {size / 1e6:8.1f} {100 * resident / max(size, 1):4.0f}  {path}")
    for package in PACKAGES:  # everything else of the package: its Python files above all
        sizes = [(resident_bytes(f), f.stat().st_size) for f in package_files((package,)) if f not in libraries]
        if sizes:
            print(f"{package}: {len(sizes)} other files, {sum(s for _, s in sizes) / 1e6:.0f} MB, "
                  f"{sum(max(r, 0) for r, _ in sizes) / 1e6:.0f} MB resident")
    print(f"all libraries: {len(rows)} files, {sum(r[1] for r in rows) / 1e9:.2f} GB, "
          f"{sum(max(r[0], 0) for r in rows) / 1e9:.2f} GB resident")


if __name__ == "__main__":
    main()
