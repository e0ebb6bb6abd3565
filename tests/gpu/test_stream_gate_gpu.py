"""StreamGate (engine/grammar/stream_gate.py) on a real device: the stream is held until the host
word reaches the sequence number, the comparison is cyclic, and a worker thread can open it while
the main thread waits for the device (torch's waits release the GIL: no deadlock)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.grammar.stream_gate import StreamGate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gated_copy(gate: StreamGate, seq: int, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    gate.wait(seq)
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    dst.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return dst, done


def test_the_copy_waits_for_the_host_word():
    gate = StreamGate.create("cuda")
    assert gate is not None
    src = torch.zeros(1 << 20, dtype=torch.int32, pin_memory=True)
    dst, done = _gated_copy(gate, 1, src)
    time.sleep(0.05)
    assert not done.query()  # held: the word is still 0
    src.fill_(7)  # written after the copy was queued, before the gate opens
    gate.open(1)
    done.synchronize()
    assert bool((dst == 7).all())


def test_the_comparison_is_cyclic():
    gate = StreamGate.create("cuda")
    src = torch.full((16,), 3, dtype=torch.int32, pin_memory=True)
    gate.open(0xFFFFFFFF)
    dst, done = _gated_copy(gate, 0x1_0000_0001, src)  # seq 1 after the wrap: later than 0xFFFFFFFF
    time.sleep(0.05)
    assert not done.query()
    gate.open(1)
    done.synchronize()
    assert dst.tolist() == [3] * 16


def test_a_worker_thread_opens_it_while_the_main_thread_waits_on_the_device():
    gate = StreamGate.create("cuda")
    src = torch.full((16,), 5, dtype=torch.int32, pin_memory=True)
    dst, done = _gated_copy(gate, 2, src)
    opener = threading.Thread(target=lambda: (time.sleep(0.05), gate.open(2)))
    opener.start()
    done.synchronize()  # releases the GIL, or the opener could never run
    assert dst.cpu().tolist() == [5] * 16
    dst, _ = _gated_copy(gate, 3, src)
    threading.Thread(target=lambda: (time.sleep(0.05), gate.open(3))).start()
    assert dst.tolist() == [5] * 16  # a device-to-host copy waits with the GIL released too
    opener.join()
