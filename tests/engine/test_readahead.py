"""engine/readahead.py: which files a start-up reads ahead, and that it reads them (and only when asked)."""

from __future__ import annotations

import logging
import sys

import pytest

from engine import readahead


def _fake_package(tmp_path, monkeypatch):
    root = tmp_path / "site" / "fakepkg"
    (root / "lib").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "__init__.py").write_text("")
    (root / "lib" / "libbig.so.1").write_bytes(b"x" * (3 * readahead.BUFFER + 5))
    (root / "lib" / "libbig.so").symlink_to("libbig.so.1")
    (root / "lib" / "libcufft.so.11").write_bytes(b"y")  # never loaded by a start-up: skipped
    (root / "lib" / "notes.txt").write_text("not a library")
    (root / "bin" / "ptxas").write_bytes(b"z" * 10)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("fakepkg", None)
    return root


def test_library_files_in_source_order_once_each(tmp_path, monkeypatch):
    root = _fake_package(tmp_path, monkeypatch)
    files = readahead.library_files(sources=(("fakepkg", ("bin", "lib")),), compiler_globs=())
    assert files == [(root / "bin" / "ptxas").resolve(), (root / "lib" / "libbig.so.1").resolve()]
    assert readahead.library_files(sources=(("no_such_package_here", ("lib",)),), compiler_globs=()) == []


def test_start_reads_every_byte_when_asked(tmp_path, monkeypatch, caplog):
    root = _fake_package(tmp_path, monkeypatch)
    files = [root / "lib" / "libbig.so.1", tmp_path / "gone.so"]  # a missing file is passed over
    monkeypatch.setenv(readahead.ENV, "0")
    assert readahead.start(files) is None
    monkeypatch.setenv(readahead.ENV, "1")
    read = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "b" not in mode:  # /proc/meminfo
            return f
        readinto = f.readinto
        f.readinto = lambda buf: read.append(readinto(buf)) or read[-1]  # noqa: B023
        return f

    monkeypatch.setattr(readahead, "open", counting_open, raising=False)
    monkeypatch.setattr(readahead, "CHUNK", readahead.BUFFER)  # the big file in 4 chunks, read side by side
    with caplog.at_level(logging.INFO, logger="engine.readahead"):
        watcher = readahead.start(files, readers=2)
        watcher.join(30)
    assert not watcher.is_alive()
    assert sum(read) == (root / "lib" / "libbig.so.1").stat().st_size
    assert "libraries ahead" in caplog.text


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_a_bad_switch_says_what_it_takes(monkeypatch, value):
    monkeypatch.setenv(readahead.ENV, value)
    with pytest.raises(ValueError, match="TANDEM_READAHEAD"):
        readahead.start([])
    monkeypatch.setenv(readahead.ENV, "")  # set but empty: the default, off
    assert readahead.start([]) is None


def test_reads_at_most_half_the_available_memory(tmp_path, monkeypatch):
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:       8 kB\n")
    cgroup.mkdir()
    assert readahead._page_cache_budget(str(meminfo), str(cgroup)) == 4096
    assert readahead._page_cache_budget(str(tmp_path / "none"), str(cgroup)) == float("inf")
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert readahead._page_cache_budget(str(meminfo), str(cgroup)) == 4096
    (cgroup / "memory.max").write_text("3000\n")  # a container's limit, less than the host's memory
    assert readahead._page_cache_budget(str(meminfo), str(cgroup)) == 1000
    big, small = tmp_path / "big.so", tmp_path / "small.so"
    big.write_bytes(b"b" * 5000)
    small.write_bytes(b"s" * 10)
    monkeypatch.setattr(readahead, "_page_cache_budget", lambda: 4096)
    monkeypatch.setenv(readahead.ENV, "1")
    queued = []
    monkeypatch.setattr(readahead, "_read_chunks", lambda chunks: queued.extend(iter(chunks.get, None)))
    readahead.start([small, big, small], readers=1).join(10)
    assert [path for path, *_ in queued] == [small]  # the file past the budget and what follows: not read


def test_a_listing_that_fails_reads_what_it_had(tmp_path, monkeypatch):
    """A folder it may not list ends the listing quietly: serve starts all the same."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"l" * 100)

    def listing():
        yield lib
        raise PermissionError("a folder this user may not read")

    monkeypatch.setenv(readahead.ENV, "1")
    read = []
    monkeypatch.setattr(readahead, "_read_chunks", lambda chunks: read.extend(iter(chunks.get, None)))
    thread = readahead.start(listing(), readers=1)
    thread.join(10)
    assert not thread.is_alive() and [path for path, *_ in read] == [lib]
