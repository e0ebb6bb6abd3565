"""Async HTTP clients for many concurrent requests: aiohttp when installed, httpx otherwise.
HttpClient's async verbs and `tandem bench --url` (the load generator) use them. The client must
not be what limits a rollout or a measurement: on a 2-core machine against a server that answers
at once, 256 concurrent /generate requests took 0.4-0.6 s with aiohttp and 2.5-5.9 s with httpx
(and an H200 server driven by httpx reached 0.51x of in-process throughput, aiohttp 0.90x).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

logger = logging.getLogger("tandem")


class HttpxClient:
    name = "httpx"

    def __init__(self, base_url: str, max_connections: Optional[int], headers: Optional[dict] = None) -> None:
        import httpx

        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections or 256)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, headers=headers)

    async def post(self, path: str, body: Optional[dict], headers: Optional[dict] = None,
                   timeout_s: Optional[float] = None) -> tuple[int, str]:
        resp = await self._client.post(path, json=body, headers=headers, timeout=timeout_s)
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

    def __init__(self, base_url: str, max_connections: Optional[int], headers: Optional[dict] = None) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=max_connections or 0)  # 0: no limit
        self._session = aiohttp.ClientSession(base_url, connector=connector, timeout=timeout, headers=headers)

    async def post(self, path: str, body: Optional[dict], headers: Optional[dict] = None,
                   timeout_s: Optional[float] = None) -> tuple[int, str]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.post(path, json=body, headers=headers, timeout=timeout) as resp:
            return resp.status, await resp.text()

    async def stream_lines(self, path: str, body: dict, headers: dict) -> AsyncIterator[str]:
        async with self._session.post(path, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:500]}")
            async for raw in resp.content:
                yield raw.decode().rstrip("\r\n")

    async def close(self) -> None:
        await self._session.close()


def open_client(base_url: str, max_connections: Optional[int], headers: Optional[dict] = None) -> Any:
    """aiohttp if it is installed (the faster client), else httpx with a warning. Call it on the
    event loop that will use the client: both belong to the loop they start on."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        logger.warning("aiohttp is not installed: many concurrent requests go through httpx, whose client "
                       "overhead can cap throughput (pip install aiohttp)")
        return HttpxClient(base_url, max_connections, headers)
    return AiohttpClient(base_url, max_connections, headers)
