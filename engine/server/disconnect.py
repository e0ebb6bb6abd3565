"""A client that goes away cancels its requests: their KV is freed at the next step instead of
decoding for nobody.

Non-streaming: the result is awaited while `request.is_disconnected()` is polled. Streaming: the
response aborts whatever it had not finished when it ends for any reason (client gone, send
failed, cancelled).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

POLL_S = 0.2


class ClientGone(Exception):
    """The client disconnected before its result was ready; its requests were aborted."""


def abort_unfinished(engine: Any, stream: Any) -> None:
    """Abort the stream's requests that have not finished (GenerateStream.pending)."""
    for rid in list(stream.pending):
        engine.abort_request(rid)


async def await_or_abort(request: Request, stream: Any, engine: Any, poll_s: float = POLL_S) -> Any:
    """`await stream`, aborting its requests (and raising ClientGone) if the client leaves first."""
    task = asyncio.ensure_future(stream)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    except BaseException:  # ClientGone, or this handler cancelled (server shutting down)
        task.cancel()
        abort_unfinished(engine, stream)
        raise


class AbortingStream(StreamingResponse):
    """An SSE response that calls `on_close` once it ends, however it ends."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def streaming_response(events: AsyncIterator[str], stream: Any, engine: Any) -> AbortingStream:
    return AbortingStream(events, lambda: abort_unfinished(engine, stream))
