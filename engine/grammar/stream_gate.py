"""StreamGate: the device's stream waits on a host word that the grammar's worker thread writes.

With it the core queues a step's mask copy and sampling while xgrammar is still filling the
mask: the copy runs once the worker has written the fill's sequence number into a pinned word
(CUDA stream memory operations, `cuStreamWaitValue32`). The core then joins the worker only when
it next waits for the device, a whole step later, instead of waiting for the fill before it can
launch the sampling; on a host-bound decode loop that wait was most of a constrained step's
extra time.

The worker writes the word after xgrammar returns, which needs the GIL: the core must never
block on the device while holding it. torch's waits (events, synchronize, copies) release it,
and the core joins the worker (MaskPrefetch.drop) before it reads a step's tokens anyway.

Only on CUDA, through the driver API (ctypes: torch has no binding for it); `create` returns
None where it is unavailable and the core waits for the fill on the host instead.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, a cyclic comparison


class StreamGate:
    def __init__(self, device: torch.device, cuda: ctypes.CDLL, wait_value, word: Optional[torch.Tensor] = None) -> None:
        self.device = device
        self._wait_value = wait_value
        # the host word the device polls: pinned here, or page-locked shared memory another process writes
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True) if word is None else word
        self._host_word = ctypes.c_uint32.from_address(self._word.data_ptr())
        pointer = ctypes.c_uint64()
        get_pointer = cuda.cuMemHostGetDevicePointer_v2
        get_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        _check(get_pointer(ctypes.byref(pointer), ctypes.c_void_p(self._word.data_ptr()), 0),
               "cuMemHostGetDevicePointer")
        self._device_word = pointer.value

    @classmethod
    def create(cls, device: torch.device | str, word: Optional[torch.Tensor] = None) -> Optional["StreamGate"]:
        """A gate on `device` (on `word`, a page-locked int32 host tensor, if given), or None off
        CUDA or where the driver lacks stream memory operations."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            wait_value = getattr(cuda, "cuStreamWaitValue32_v2", None) or cuda.cuStreamWaitValue32
            wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            gate = cls(device, cuda, wait_value, word)
            if word is None:
                gate.open(0)
            if not gate.wait(gate.value()):  # satisfied at once: proves the driver takes the call
                return None
            return gate
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.info("grammar masks are waited for on the host: no CUDA stream wait (%s)", exc)
            return None

    def wait(self, seq: int) -> bool:
        """Queue, on the device's current stream, a wait until the word reaches `seq` (cyclic);
        False if the driver refused it (nothing was queued)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        result = self._wait_value(ctypes.c_void_p(stream), self._device_word, seq & 0xFFFFFFFF, WAIT_GEQ)
        if result != 0:
            logger.warning("cuStreamWaitValue32 failed (CUresult %d); waiting on the host", result)
            return False
        return True

    def value(self) -> int:
        return self._host_word.value

    def open(self, seq: int) -> None:
        """Let the device past every wait up to `seq` (a plain store into the pinned word)."""
        self._host_word.value = seq & 0xFFFFFFFF


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed (CUresult {result})")
