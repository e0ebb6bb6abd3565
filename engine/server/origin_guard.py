"""Control routes refuse what a web browser sends on a page's behalf.

A server without keys (the default, on 127.0.0.1) would otherwise obey any page its user opens:
an image tag's `GET /release_memory_occupation`, or a form's bodiless POST to /flush_cache, needs
no CORS preflight. Browsers mark such requests and pages cannot remove the marks: `Origin` (on
every cross-origin POST) and `Sec-Fetch-Site` (on every request of current browsers, image loads
too). A request with an Origin outside `--allowed-origins` (empty by default), or one marked
cross-site or same-site, is a 403; Python clients (requests, httpx, aiohttp) send neither header
and pass, bodiless or not.
"""

from __future__ import annotations

from typing import Iterable, Optional

# "none": typed in the address bar or a bookmark, user-initiated; "same-origin": the server's own page
TRUSTED_FETCH_SITES = frozenset({b"same-origin", b"none"})


class OriginGuard:
    def __init__(self, allowed_origins: Iterable[str] = ()) -> None:
        self.allowed = frozenset(_normalized(o.encode("latin-1", "replace")) for o in allowed_origins)

    def refusal(self, headers: dict[bytes, bytes]) -> Optional[str]:
        """Why a control request with these (lower-cased) headers is refused; None to let it through."""
        origin = headers.get(b"origin")
        if origin is not None:
            if _normalized(origin) in self.allowed:
                return None
            shown = origin.decode("latin-1")[:200]
            return (f"control routes refuse browser requests: origin {shown!r} is not allowed (start the server "
                    f"with --allowed-origins {shown} to let its pages call them)")
        site = headers.get(b"sec-fetch-site")
        if site is not None and site.strip().lower() not in TRUSTED_FETCH_SITES:
            return (f"control routes refuse browser requests: this one is marked Sec-Fetch-Site: "
                    f"{site.decode('latin-1')[:40]} (a page on another site sent it)")
        return None


def _normalized(origin: bytes) -> bytes:
    return origin.strip().rstrip(b"/").lower()
