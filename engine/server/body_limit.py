"""Request body size limits: a body over the limit is refused with 413 as soon as its
Content-Length (or, when chunked, its running size) says so, before it is parsed. The body is
read here and replayed to the app. Three limits: the routes that carry tensors (--max-body-bytes,
1 GiB), generation (--max-generate-body-bytes) and every other route (--max-control-body-bytes:
a pause, an abort or a weight group's names are kilobytes, and a body FastAPI parses holds the
event loop while it does: 420 MB of JSON to /abort_request held it 16 s)."""

from __future__ import annotations

from typing import Any, Optional

from engine.server.errors import error_response

GENERATE_PREFIXES = ("/generate", "/v1/", "/tokenize", "/detokenize")
PAYLOAD_ROUTES = frozenset({"/update_weights_from_tensor", "/load_lora_adapter_from_tensors"})
FLAGS = {"payload": "--max-body-bytes", "generate": "--max-generate-body-bytes", "control": "--max-control-body-bytes"}


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int, max_generate_bytes: int, max_control_bytes: int) -> None:
        self.app = app
        self.limits = {"payload": max_bytes, "generate": max_generate_bytes, "control": max_control_bytes}

    @staticmethod
    def kind_of(path: str) -> str:
        if path.rstrip("/") in PAYLOAD_ROUTES:
            return "payload"
        return "generate" if path.startswith(GENERATE_PREFIXES) else "control"

    def limit_for(self, path: str) -> int:
        return self.limits[self.kind_of(path)]

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
    path = scope.get("path", "")
    message = (f"request body is over the limit of {limit} bytes for {path} "
               f"({FLAGS[BodyLimitMiddleware.kind_of(path)]})")
    await error_response(message, 413)(scope, receive, send)
