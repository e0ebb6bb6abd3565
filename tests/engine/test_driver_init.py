"""start_driver_init (engine/core/driver_init.py): cuInit on a thread only when asked and only for
a CUDA device; a machine without the driver is no error (torch reports no GPU later)."""

from __future__ import annotations

import ctypes.util

import pytest

from engine.core import driver_init


@pytest.mark.parametrize("environ, device", [({}, "cuda"), ({"TANDEM_EARLY_CUDA_INIT": "0"}, "auto"),
                                             ({"TANDEM_EARLY_CUDA_INIT": "1"}, "cpu")])
def test_nothing_starts_unless_asked_for_a_cuda_device(environ, device):
    assert driver_init.start_driver_init(device, environ) is None


@pytest.mark.parametrize("library", ["libno-such-driver.so.1", ctypes.util.find_library("c") or "libc.so.6"])
def test_a_missing_driver_or_symbol_ends_the_thread_quietly(monkeypatch, library):
    """No library at all, or a library without cuInit (libc): the thread ends, nothing raised."""
    monkeypatch.setattr(driver_init, "LIBRARY", library)
    errors = []
    monkeypatch.setattr("threading.excepthook", lambda args: errors.append(args.exc_value))
    for device in ("auto", "cuda:1"):
        thread = driver_init.start_driver_init(device, {"TANDEM_EARLY_CUDA_INIT": "1"})
        assert thread is not None and thread.daemon
        thread.join(10)
        assert not thread.is_alive()
    assert errors == []
