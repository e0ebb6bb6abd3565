"""A client that goes away cancels its requests: their KV is freed at the next step instead of
decoding for nobody.

Non-streaming: the result is awaited beside the client's http.disconnect. Streaming: the
response aborts whatever it had not finished when it ends for any reason (client gone, send
failed, cancelled, or the client stopped reading: engine/server/stream_watch.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.server.stream_watch import CHECK_S, StreamLimits, StreamWatch

logger = logging.getLogger("tandem")

class ClientGone(Exception):
    """The client disconnected before its result was ready; its requests were aborted."""


def abort_unfinished(engine: Any, stream: Any) -> None:
    """Abort the stream's requests that have not finished (GenerateStream.pending)."""
    for rid in list(stream.pending):
        engine.abort_request(rid)


async def await_or_abort(request: Request, stream: Any, engine: Any) -> Any:
    """`await stream`, aborting its requests (and raising ClientGone) if the client leaves first.
    The leaving is the ASGI receive channel's http.disconnect, awaited beside the result: one
    wake-up per request, where polling `request.is_disconnected()` cost the event loop ~40 us
    five times a second per request in flight."""
    task = asyncio.ensure_future(stream)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    except BaseException:  # ClientGone, or this handler cancelled (server shutting down)
        task.cancel()
        abort_unfinished(engine, stream)
        raise
    finally:
        gone.cancel()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects: after the body (read by the route), the next message
    an ASGI server delivers is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AbortingStream(StreamingResponse):
    """An SSE response that calls `on_close` once it ends, however it ends, and ends itself once
    its client is over its StreamLimits (the connection is then closed without a last event)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], limits: StreamLimits,
                 held_bytes: Callable[[], int] = lambda: 0) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close
        self.limits = limits
        self.held_bytes = held_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = StreamWatch(send, self.limits, self.held_bytes)
        task = asyncio.ensure_future(super().__call__(scope, receive, watch.send))
        try:
            while not (await asyncio.wait({task}, timeout=CHECK_S))[0]:
                why = watch.overrun()
                if why is not None:
                    logger.warning("%s: a streaming client %s; aborting its requests", scope.get("path"), why)
                    break
            else:
                return task.result()
        finally:
            task.cancel()
            self.on_close()
        await asyncio.wait({task})  # the cancelled send lets go of its event


def streaming_response(events: AsyncIterator[str], stream: Any, engine: Any) -> AbortingStream:
    def close() -> None:
        abort_unfinished(engine, stream)
        stream.close()

    return AbortingStream(events, close, StreamLimits.of(engine.server_args), stream.unread_bytes)
