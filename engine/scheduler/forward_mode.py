"""ForwardMode: what kind of forward pass a batch is, decided by the scheduler, run by the runner."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly chunked, possibly over a cached prefix)
    DECODE = "decode"  # one new token per sequence

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE
