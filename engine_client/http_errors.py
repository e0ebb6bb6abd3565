"""What HttpClient raises when a server gives no usable answer: each error names the URL.

EngineUnreachable (a ConnectionError): refused, not connected in time, reset, closed or cut off
mid-reply, or a 503. No answer is coming from that server, so a caller with several may send the
request elsewhere (rollout/manager.py does). EngineTimeout (a TimeoutError): no answer within the client's
timeout_s. A 400 is a ValueError with the server's message (SGLang's error JSON), other statuses
and bodies that are not JSON (a proxy's HTML page) a RuntimeError with the start of the body.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

BODY_SHOWN = 300  # characters of an error body in a message: a proxy's page can be long


class EngineUnreachable(ConnectionError):
    """The server gave no answer (it is down, restarting or dropped the connection)."""


class EngineTimeout(TimeoutError):
    """The server answered nothing within the client's timeout."""


def transport_error(where: str, exc: BaseException, timeout_s: Optional[float]) -> Exception:
    """An aiohttp / httpx / socket failure of the request `where` ("POST http://h:p/route") ->
    EngineTimeout or EngineUnreachable naming it."""
    if _is_connect_timeout(exc):  # nothing was sent: as unreachable as a refusal (another engine may take it)
        return EngineUnreachable(f"{where}: could not connect in time ({type(exc).__name__}); is the server up?")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or type(exc).__name__.endswith("Timeout"):
        limit = f"within {timeout_s:g} s" if timeout_s else "in time"
        return EngineTimeout(f"{where}: no answer {limit} (HttpClient's timeout_s)")
    detail = str(exc) or "no detail"
    return EngineUnreachable(f"{where}: no answer from the server ({type(exc).__name__}: {detail}); is it running?")


def _is_connect_timeout(exc: BaseException) -> bool:
    return type(exc).__name__ in ("ConnectTimeout", "ConnectionTimeoutError")  # httpx's, aiohttp's


class Answer:
    """An async client's (status, text), read as an httpx response is."""

    def __init__(self, status_code: int, text: str) -> None:
        self.status_code, self.text = status_code, text

    def json(self) -> Any:
        return json.loads(self.text)


def generate_reply(response: Any, where: str) -> Any:
    """/generate's reply -> its JSON; anything else raises, naming `where`."""
    if response.status_code == 200:
        payload = json_or_none(response)
        if payload is None:
            raise RuntimeError(f"{where} answered HTTP 200 with a body that is not JSON (a proxy in the "
                               f"way?): {_shown(response.text)}")
        return payload
    raise status_error(response, where)


def status_error(response: Any, where: str) -> Exception:
    if response.status_code == 400:  # as Engine raises for a refused request
        return ValueError(f"{where} refused the request: {message(response)}")
    text = f"{where} failed with HTTP {response.status_code}: {message(response)}"
    return EngineUnreachable(text) if response.status_code == 503 else RuntimeError(text)


def json_or_none(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def message(response: Any) -> str:
    """The error text of SGLang's bodies: {"message"} or {"error": {"message"}}, else the raw text."""
    payload = json_or_none(response)
    if isinstance(payload, dict):
        if isinstance(payload.get("error"), dict):
            return str(payload["error"].get("message"))
        if "message" in payload:
            return str(payload["message"])
    return _shown(response.text)


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= BODY_SHOWN else f"{text[:BODY_SHOWN]}... ({len(text)} characters)"
