"""TokenSlotAllocator: hands out KV pool slots 1..size (slot 0 is the padding slot).

The free list is a ring buffer over a CPU int64 tensor: alloc takes from the head, free
appends at the tail, so both cost O(n) in the request size, never O(pool size).
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    def __init__(self, size: int, debug: bool = False):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        # debug: track which slots are free, so double frees and foreign slots raise
        self.debug = debug
        self._buf = torch.empty(max(size, 1), dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        """Everything free again, in slot order (1..size)."""
        self._buf[: self.size] = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._head = 0
        self._count = self.size
        if self.debug:
            self._is_free = torch.ones(self.size + 1, dtype=torch.bool)
            self._is_free[0] = False

    def available_size(self) -> int:
        return self._count

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots as a fresh int64 tensor, or None if fewer than n are free (never partial)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._count:
            return None
        out = self._read(self._head, n)
        self._head = (self._head + n) % len(self._buf)
        self._count -= n
        if self.debug:
            self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        slots = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        if self.debug:
            self._check_freeable(slots)
        if self._count + n > self.size:
            raise RuntimeError(
                f"freeing {n} slots would exceed the pool ({self._count} free of {self.size}): "
                "double free"
            )
        if self.debug:
            self._is_free[slots] = True
        self._write((self._head + self._count) % len(self._buf), slots)
        self._count += n

    # ---- ring buffer ------------------------------------------------------------------------
    def _read(self, start: int, n: int) -> torch.Tensor:
        cap = len(self._buf)
        first = min(n, cap - start)
        if first == n:
            return self._buf[start : start + n].clone()
        return torch.cat((self._buf[start:], self._buf[: n - first]))

    def _write(self, start: int, slots: torch.Tensor) -> None:
        cap, n = len(self._buf), slots.numel()
        first = min(n, cap - start)
        self._buf[start : start + first] = slots[:first]
        if first < n:
            self._buf[: n - first] = slots[first:]

    def _check_freeable(self, slots: torch.Tensor) -> None:
        if int(slots.min()) < 1 or int(slots.max()) > self.size:
            raise ValueError(f"slot out of range 1..{self.size}: {slots.tolist()}")
        if torch.unique(slots).numel() != slots.numel():
            raise RuntimeError(f"double free: duplicate slots in one free call {slots.tolist()}")
        already = slots[self._is_free[slots]]
        if already.numel():
            raise RuntimeError(f"double free of slots {already.tolist()}")
