"""JSON for replies and server-sent events, as FastAPI serializes a route's return value: non-finite
floats (a NaN logprob of a degenerate distribution, -inf of a masked token) become null, which
strict JSON parsers accept (json.dumps would write NaN / -Infinity, which they refuse)."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

_ANY = TypeAdapter(Any)


def json_bytes(payload: Any) -> bytes:
    return _ANY.dump_json(payload)


def sse_event(payload: Any) -> str:
    """One `data:` event of a stream."""
    return f"data: {json_bytes(payload).decode()}\n\n"
