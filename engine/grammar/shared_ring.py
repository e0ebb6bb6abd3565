"""SharedSegment and SharedBitmaskRing: the grammar process's bitmasks and gate word, in shared memory.

One segment holds the gate word (the device waits on it; engine/grammar/stream_gate.py) and a
ring of RING_DEPTH packed bitmask buffers of `capacity` rows. The grammar process writes them;
the core copies them to the device. On CUDA the core registers the whole segment with the driver
(cudaHostRegister): the copy engine reads it directly and the gate word has a device address. A
batch larger than the capacity moves the ring to a new segment twice as large.

The segment is an anonymous memory file (memfd), its descriptor passed over the process's pipe:
not a /dev/shm name, whose size Docker caps at 64 MB by default (a 1024-row segment is ~78 MB at
a 152k vocabulary; past the cap a write is a SIGBUS) and which a killed core would leave behind.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from typing import Optional

import torch

from engine.grammar.bitmask_ring import RING_DEPTH, BitmaskRing

HEADER_BYTES = 64  # the gate word, alone on its cache line
_labels = itertools.count(1)


def segment_bytes(capacity: int, vocab_size: int) -> int:
    return HEADER_BYTES + RING_DEPTH * capacity * ((vocab_size + 31) // 32) * 4


class SharedSegment:
    @torch.inference_mode(False)  # normal tensors: written inside the runner's inference mode and outside it
    def __init__(self, fd: int, capacity: int, vocab_size: int, owner: bool, label: str) -> None:
        """Map `fd` (a memfd of segment_bytes); the owner keeps the descriptor (to send it), an
        attached process closes it once mapped."""
        self.capacity, self.label = capacity, label
        self.size = segment_bytes(capacity, vocab_size)
        self.words = (vocab_size + 31) // 32
        self._mmap = mmap.mmap(fd, self.size)
        self.fd: Optional[int] = fd if owner else None
        if not owner:
            os.close(fd)
        self.word = torch.frombuffer(self._mmap, dtype=torch.int32, count=1)
        self._word = ctypes.c_uint32.from_buffer(self._mmap)
        size = RING_DEPTH * capacity * self.words
        rings = torch.frombuffer(self._mmap, dtype=torch.int32, count=size, offset=HEADER_BYTES)
        self.buffers = list(rings.view(RING_DEPTH, capacity, self.words).unbind(0))
        self.registered = False

    @classmethod
    def create(cls, capacity: int, vocab_size: int) -> "SharedSegment":
        label = f"tandem-grammar-masks-{os.getpid()}-{next(_labels)}"
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, segment_bytes(capacity, vocab_size))
            return cls(fd, capacity, vocab_size, owner=True, label=label)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, label: str, capacity: int, vocab_size: int) -> "SharedSegment":
        return cls(fd, capacity, vocab_size, owner=False, label=label)

    def buffer(self, slot: int) -> torch.Tensor:
        return self.buffers[slot]

    def open_gate(self, seq: int) -> None:
        self._word.value = seq & 0xFFFFFFFF

    def register(self) -> bool:
        """Page-lock the segment for the device (CUDA); False if the driver refused."""
        cudart = torch.cuda.cudart()
        ok = int(cudart.cudaHostRegister(self._address(), self.size, 0)) == 0
        self.registered = ok and self.buffers[0].is_pinned()
        return self.registered

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self._address())
            self.registered = False
        del self._word
        self.word = self.buffers = None  # the views must go before the mapping
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view: the mapping goes with the last one
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))


class SharedBitmaskRing(BitmaskRing):
    """A BitmaskRing whose buffers are a SharedSegment's (a batch must fit its capacity: the
    client grows the segment first)."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        super().__init__(vocab_size, device)
        self.segment: Optional[SharedSegment] = None

    def use(self, segment: SharedSegment) -> None:
        """Move to `segment` once every copy from the old buffers has run."""
        self.wait_copies()
        self.segment = segment
        self._slots = list(segment.buffers)

    def release(self) -> None:
        """Forget the segment's buffers (its mapping can close once no view is left)."""
        self.wait_copies()
        self.segment = None
        self._slots = [None] * len(self._slots)

    def slot_of(self, bitmask: torch.Tensor) -> int:
        slot = self._slot_of(bitmask)
        assert slot is not None, "not a buffer of this ring"
        return slot

    def _new_buffer(self, rows: int) -> torch.Tensor:
        raise AssertionError(f"{rows} rows exceed the shared ring's capacity {self.segment.capacity}")
