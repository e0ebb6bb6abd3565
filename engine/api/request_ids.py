"""fresh_rid: a request id as uuid4().hex spells it, without a system call per request.

Each uuid4() reads 16 bytes from os.urandom, a system call that lets go of the GIL: on a busy
`tandem serve` the event loop then waits for the core client's threads to hand it back (py-spy:
a quarter of the loop's time per /generate went to uuid4 at 64 concurrent requests). The bytes
come from os.urandom all the same, 4 KiB at a time; ids stay unguessable (a client could
otherwise abort another's request by its id).
"""

from __future__ import annotations

import os
import threading

_POOL_BYTES = 4096
_lock = threading.Lock()
_pool = b""
_offset = 0


def _forget_pool() -> None:
    """In a forked child: its own bytes (not the ids its parent hands out next) and a lock no
    parent thread held at the fork."""
    global _lock, _pool, _offset
    _lock, _pool, _offset = threading.Lock(), b"", 0


os.register_at_fork(after_in_child=_forget_pool)


def fresh_rid() -> str:
    """32 hex digits with uuid4's version and variant bits."""
    global _pool, _offset
    with _lock:
        if _offset + 16 > len(_pool):
            _pool, _offset = os.urandom(_POOL_BYTES), 0
        raw = bytearray(_pool[_offset:_offset + 16])
        _offset += 16
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()
