"""Who may call what: `--api-key` guards generation and info routes, `--admin-api-key` the
control routes (pause, weight updates, flush, memory, profiling), so a rollout client holding the
generation key cannot take the engine over. /abort_request by rid takes either key (a rollout
worker ends its own long tail, as SGLang's api key allows); its abort_all needs the admin key
(the route checks, `is_admin`). Without an admin key, control routes take the api key (one key
for everything, as before). /health and /health_generate are open.

Control routes also refuse browser-originated requests (engine/server/origin_guard.py), keys or not.
Pure ASGI (no BaseHTTPMiddleware), so streaming and disconnect detection pass through untouched.
Keys are compared as bytes: a header with non-ASCII bytes is a 401, never a 500.
"""

from __future__ import annotations

import hmac
from typing import Any, Optional

from engine.server.errors import error_response
from engine.server.origin_guard import OriginGuard

OPEN_ROUTES = frozenset({"/health", "/health_generate"})
ADMIN_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
    "/update_weights_from_distributed", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weight_version", "/flush_cache", "/release_memory_occupation",
    "/resume_memory_occupation", "/start_profile", "/stop_profile", "/begin_weight_update", "/end_weight_update",
    "/weights_checker", "/post_process_weights", "/freeze_gc",
    "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors", "/pull_weights",
})
ORIGIN_GUARDED = ADMIN_ROUTES | {"/abort_request"}  # a web page must not end the server's requests


class AccessPolicy:
    def __init__(self, api_key: Optional[str], admin_api_key: Optional[str]) -> None:
        self.api = _bearer(api_key)
        self.admin = _bearer(admin_api_key)

    def keys_for(self, path: str) -> list[bytes]:
        """The Authorization values that open `path`; empty when it is open to anyone."""
        if path in OPEN_ROUTES:
            return []
        if path in ADMIN_ROUTES:
            return [self.admin] if self.admin else [self.api] if self.api else []
        if not self.api:
            return []
        return [self.api] + ([self.admin] if self.admin else [])

    def is_admin(self, given: bytes) -> bool:
        """Whether an Authorization value opens the control routes."""
        key = self.admin or self.api
        return key is None or hmac.compare_digest(given, key)

    def allows(self, path: str, given: bytes) -> bool:
        keys = self.keys_for(path)
        # every key is compared, so the time taken does not say which one nearly matched
        return not keys or any([hmac.compare_digest(given, key) for key in keys])


class AccessMiddleware:
    def __init__(self, app: Any, policy: AccessPolicy, origins: Optional[OriginGuard] = None) -> None:
        self.app = app
        self.policy = policy
        self.origins = origins or OriginGuard()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])  # ASGI header names are lower-case
            refusal = self.origins.refusal(headers) if scope.get("path") in ORIGIN_GUARDED else None
            if refusal is not None:
                await error_response(refusal, 403)(scope, receive, send)
                return
            given = authorization(scope)
            if not self.policy.allows(scope.get("path", ""), given):
                admin = scope.get("path") in ADMIN_ROUTES and self.policy.admin
                which = "admin api key" if admin else "api key"
                await error_response(f"missing or wrong {which} (Authorization: Bearer <key>)", 401)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def authorization(scope: dict) -> bytes:
    """The request's Authorization value; b"" when there is none, or more than one (which one a
    proxy or a framework reads differs: neither is taken)."""
    sent = [value for name, value in scope.get("headers") or [] if name == b"authorization"]
    return sent[0] if len(sent) == 1 else b""


def _bearer(key: Optional[str]) -> Optional[bytes]:
    return f"Bearer {key}".encode() if key else None
