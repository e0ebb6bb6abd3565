"""StreamWatch: a streaming client that stops reading is cut off, and everything it held freed.

An SSE response writes each event to the client's socket; once the socket's buffers are full,
the server's `send` waits for the client to read. StreamWatch wraps that `send` and knows, at any
moment, since when a send has been waiting and how many bytes the client has not taken: those
handed to the waiting send plus (estimated from list lengths) the outputs its stream holds.
A response whose send waits longer than `stream_stall_timeout` seconds, or holds more than
`max_unread_stream_bytes` unread, is over its bound: its requests are aborted in the core (KV
freed at the next step), its stream drops what it holds, and the connection is closed. Outputs
that arrive meanwhile never pile up (GenerateStream keeps the newest per request only).
A stream waiting for the engine (a long prefill, a pause) sends nothing and is never over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

CHECK_S = 0.25  # how often a streaming response looks at its client


@dataclass(frozen=True)
class StreamLimits:
    stall_timeout_s: float = 30.0
    max_unread_bytes: int = 64 << 20

    @classmethod
    def of(cls, server_args: Any) -> "StreamLimits":
        return cls(server_args.stream_stall_timeout, server_args.max_unread_stream_bytes)


class StreamWatch:
    def __init__(self, send: Any, limits: StreamLimits, held_bytes: Callable[[], int] = lambda: 0) -> None:
        self._send = send
        self.limits = limits
        self.held_bytes = held_bytes  # the outputs waiting to become events
        self.unread_bytes = 0  # handed to sends that have not returned
        self.waiting_since: Optional[float] = None  # time.monotonic() when the oldest unfinished send began

    async def send(self, message: dict) -> None:
        size = len(message.get("body", b""))
        self.unread_bytes += size
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        try:
            await self._send(message)
        finally:
            self.unread_bytes -= size
            self.waiting_since = None

    def overrun(self) -> Optional[str]:
        """Why this client is over its bound, or None."""
        if self.waiting_since is None:  # the client took everything sent so far
            return None
        unread = self.unread_bytes + self.held_bytes()
        if unread > self.limits.max_unread_bytes:
            return f"left ~{unread} bytes unread, over max_unread_stream_bytes ({self.limits.max_unread_bytes})"
        stalled = time.monotonic() - self.waiting_since
        if stalled > self.limits.stall_timeout_s:
            return f"read nothing for {stalled:.1f} s, over stream_stall_timeout ({self.limits.stall_timeout_s} s)"
        return None
