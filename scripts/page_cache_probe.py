"""Which of a start-up's libraries are in the page cache, and how much of each (readahead's list).

Run after a start on a fresh machine: the resident bytes of every shared object under torch, the
`nvidia` wheels and Triton say what a start-up reads (engine/readahead.py reads those ahead).
--evict drops those files and the Python packages' own files from the page cache instead
(POSIX_FADV_DONTNEED; no root needed), so the next start reads them from the disk again.

    python scripts/page_cache_probe.py [--top 40] [--evict]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import readahead  # noqa: E402

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


def package_files(packages=PACKAGES) -> list[Path]:
    files = []
    for package in packages:
        for root in readahead._package_dirs(package):
            files += [p.resolve() for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return list(dict.fromkeys(files))


def evict_start_files() -> int:
    """Every file of PACKAGES and the C compiler out of the page cache; how many were dropped."""
    return evict(list(dict.fromkeys(package_files() + readahead.library_files(skip=()))))


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
    every = readahead.library_files(skip=())
    listed = set(readahead.library_files())
    rows = sorted(((resident_bytes(f), f.stat().st_size, f) for f in every), key=lambda r: -r[0])
    if any(r[0] < 0 for r in rows):
        print("(-1: not known; run as the files' owner or root)")
    print(f"{'resident MB':>11s} {'size MB':>8s} {'%':>4s} read-ahead  file")
    for resident, size, path in rows[:args.top]:
        print(f"{resident / 1e6:11.1f} {size / 1e6:8.1f} {100 * resident / max(size, 1):4.0f} "
              f"{'yes' if path in listed else 'no ':>10s}  {path}")
    for package in PACKAGES:  # everything else of the package: its Python files above all
        sizes = [(resident_bytes(f), f.stat().st_size) for f in package_files((package,)) if f not in listed]
        if sizes:
            print(f"{package}: {len(sizes)} other files, {sum(s for _, s in sizes) / 1e6:.0f} MB, "
                  f"{sum(max(r, 0) for r, _ in sizes) / 1e6:.0f} MB resident")
    for name, keep in (("all libraries", lambda p: True), ("read ahead", lambda p: p in listed)):
        sub = [r for r in rows if keep(r[2])]
        print(f"{name}: {len(sub)} files, {sum(r[1] for r in sub) / 1e9:.2f} GB, "
              f"{sum(max(r[0], 0) for r in sub) / 1e9:.2f} GB resident")


if __name__ == "__main__":
    main()
