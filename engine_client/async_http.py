"""Async HTTP clients for many concurrent requests: aiohttp when installed, httpx otherwise.
HttpClient's async verbs and `tandem bench --url` (the load generator) use them. The client must
not be what limits a rollout or a measurement: on a 2-core machine against a server that answers
at once, 256 concurrent /generate requests took 0.4-0.6 s with aiohttp and 2.5-5.9 s with httpx
(and an H200 server driven by httpx reached 0.51x of in-process throughput, aiohttp 0.90x).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from engine_client.http_errors import transport_error

logger = logging.getLogger("tandem")


class HttpxClient:
    """Transport failures raise http_errors' EngineUnreachable / EngineTimeout, naming the URL."""

    name = "httpx"

    def __init__(self, base_url: str, max_connections: Optional[int], headers: Optional[dict] = None,
                 connect_timeout_s: Optional[float] = None) -> None:
        import httpx

        self.base_url, self._connect_s = base_url.rstrip("/"), connect_timeout_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections or 256)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, headers=headers)

    async def post(self, path: str, body: Optional[dict], headers: Optional[dict] = None,
                   timeout_s: Optional[float] = None) -> tuple[int, str]:
        import httpx

        try:
            resp = await self._client.post(path, json=body, headers=headers,
                                           timeout=httpx.Timeout(timeout_s, connect=self._connect_s))
        except httpx.TransportError as exc:
            raise transport_error(f"POST {self.base_url}{path}", exc, timeout_s) from exc
        return resp.status_code, resp.text

    async def stream_lines(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        import httpx

        try:
            async with self._client.stream("POST", path, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"{path} answered {resp.status_code}: {(await resp.aread())[:500]!r}")
                async for line in resp.aiter_lines():
                    yield line
        except httpx.TransportError as exc:  # a stream cut off mid-way is one too
            raise transport_error(f"POST {self.base_url}{path} (streaming)", exc, None) from exc

    async def close(self) -> None:
        await self._client.aclose()


class AiohttpClient:
    """Transport failures raise http_errors' EngineUnreachable / EngineTimeout, naming the URL."""

    name = "aiohttp"

    def __init__(self, base_url: str, max_connections: Optional[int], headers: Optional[dict] = None,
                 connect_timeout_s: Optional[float] = None) -> None:
        import aiohttp

        self.base_url, self._connect_s = base_url.rstrip("/"), connect_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=max_connections or 0)  # 0: no limit
        self._session = aiohttp.ClientSession(base_url, connector=connector, timeout=timeout, headers=headers)

    async def post(self, path: str, body: Optional[dict], headers: Optional[dict] = None,
                   timeout_s: Optional[float] = None) -> tuple[int, str]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_s)
        try:
            async with self._session.post(path, json=body, headers=headers, timeout=timeout) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise transport_error(f"POST {self.base_url}{path}", exc, timeout_s) from exc

    async def stream_lines(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        import aiohttp

        try:
            async with self._session.post(path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:500]}")
                async for raw in resp.content:
                    yield raw.decode().rstrip("\r\n")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # a stream cut off mid-way is one too
            raise transport_error(f"POST {self.base_url}{path} (streaming)", exc, None) from exc

    async def close(self) -> None:
        await self._session.close()


def open_client(base_url: str, max_connections: Optional[int], headers: Optional[dict] = None,
                connect_timeout_s: Optional[float] = None) -> Any:
    """aiohttp if it is installed (the faster client), else httpx with a warning. Call it on the
    event loop that will use the client: both belong to the loop they start on."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        logger.warning("aiohttp is not installed: many concurrent requests go through httpx, whose client "
                       "overhead can cap throughput (pip install aiohttp)")
        return HttpxClient(base_url, max_connections, headers, connect_timeout_s)
    return AiohttpClient(base_url, max_connections, headers, connect_timeout_s)
