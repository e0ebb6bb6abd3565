"""The load generator's HTTP clients for `tandem bench --url`: aiohttp when installed, httpx
otherwise. The client must not be what limits a measurement: measured on a 2-core machine
against a server that answers at once, 256 concurrent /generate requests took 0.4-0.6 s with
aiohttp and 2.5-5.9 s with httpx, so httpx alone would cap the figure well below the engine's.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

logger = logging.getLogger("tandem")


class HttpxClient:
    name = "httpx"

    def __init__(self, base_url: str, max_connections: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits)

    async def post(self, path: str, body: Optional[dict], headers: dict) -> tuple[int, str]:
        resp = await self._client.post(path, json=body, headers=headers)
        return resp.status_code, resp.text

    async def stream_lines(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with self._client.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{path} answered {resp.status_code}: {(await resp.aread())[:500]!r}")
            async for line in resp.aiter_lines():
                yield line

    async def close(self) -> None:
        await self._client.aclose()


class AiohttpClient:
    name = "aiohttp"

    def __init__(self, base_url: str, max_connections: int) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None)
        self._session = aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=max_connections),
                                              timeout=timeout)

    async def post(self, path: str, body: Optional[dict], headers: dict) -> tuple[int, str]:
        async with self._session.post(path, json=body, headers=headers) as resp:
            return resp.status, await resp.text()

    async def stream_lines(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with self._session.post(path, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:500]}")
            async for raw in resp.content:
                yield raw.decode().rstrip("\r\n")

    async def close(self) -> None:
        await self._session.close()


def open_client(base_url: str, max_connections: int) -> Any:
    """aiohttp if it is installed (the faster load generator), else httpx with a warning."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        logger.warning("aiohttp is not installed: the bench drives the server with httpx, whose client "
                       "overhead can cap the measured throughput (pip install aiohttp)")
        return HttpxClient(base_url, max_connections)
    return AiohttpClient(base_url, max_connections)
