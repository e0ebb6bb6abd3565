"""SGLang's error body, used by every route and middleware of the server."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# 400's type as SGLang's OpenAI routes name it (serving_base.create_error_response); the others the HTTP phrase
_KINDS = {400: "BadRequestError", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 413: "Payload Too Large",
          503: "Service Unavailable"}


def error_body(message: str, code: int = 400) -> dict:
    return {"object": "error", "message": message, "type": _KINDS.get(code, "Error"), "param": None, "code": code}


def error_response(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, code), status_code=code)
