"""abort_reason: a request's finish_reason when it ends without finishing, in SGLang's shape
(FINISH_ABORT.to_json: type, message, status_code, err_type, the last two null unless known)."""

from __future__ import annotations

from typing import Any, Optional


def abort_reason(message: str, status_code: Optional[int] = None, err_type: Optional[str] = None) -> dict[str, Any]:
    """status_code: the HTTP status a non-streamed request answers with (400: the request's fault)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
