"""Request body size limits: a body over the limit is refused with 413 as soon as its
Content-Length (or, when chunked, its running size) says so, before it is parsed. The body is
read here and replayed to the app. Generation routes get a smaller limit than weight payloads."""

from __future__ import annotations

from typing import Any, Optional

from engine.server.errors import error_response

GENERATE_PREFIXES = ("/generate", "/v1/", "/tokenize", "/detokenize")


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int, max_generate_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_generate_bytes = max_generate_bytes

    def limit_for(self, path: str) -> int:
        return self.max_generate_bytes if path.startswith(GENERATE_PREFIXES) else self.max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await error_response("Content-Length must be a non-negative integer", 400)(scope, receive, send)
                return
            if int(declared) > limit:
                await _too_large(limit, scope, receive, send)
                return
        body = await _read_body(receive, limit)
        if body is None:  # over the limit, or the client left while sending
            await _too_large(limit, scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: http.disconnect when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _read_body(receive: Any, limit: int) -> Optional[bytes]:
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _too_large(limit: int, scope: dict, receive: Any, send: Any) -> None:
    message = (f"request body is over the limit of {limit} bytes for {scope.get('path')} "
               "(--max-body-bytes, --max-generate-body-bytes)")
    await error_response(message, 413)(scope, receive, send)
