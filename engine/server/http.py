"""The HTTP server: SGLang's native routes plus the OpenAI-compatible ones, over one Engine.

Bad input comes back as 400 with SGLang's error body and the engine keeps serving. Unknown
request fields are ignored, as SGLang does. Keys (engine/server/access.py): `api_key` guards
generation and info routes, `admin_api_key` the control routes; /health stays open. Bodies are
size-limited (engine/server/body_limit.py). `tandem serve` (tandem/serve.py) runs it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.server.access import AccessMiddleware, AccessPolicy
from engine.server.body_limit import BodyLimitMiddleware
from engine.server.control_routes import add_control_routes, add_weights_checker_route
from engine.server.disconnect import ClientGone
from engine.server.errors import error_response
from engine.server.generate_routes import add_generate_routes
from engine.server.info_routes import add_info_routes
from engine.server.lora_routes import add_lora_routes
from engine.server.maintenance_routes import add_maintenance_routes
from engine.server.openai import OpenAIServing
from engine.server.origin_guard import OriginGuard
from engine.server.protocol import UnknownFields
from engine.server.pull_weights_route import add_pull_weights_route
from engine.server.served_model import ServedModel
from engine.server.tokenize_routes import add_tokenize_routes

logger = logging.getLogger("tandem")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, logs show why
BODY_PARSE_DETAIL = "There was an error parsing the body"  # FastAPI's words for a body json.loads refused


def create_app(engine: Any, api_key: Optional[str] = None, admin_api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="tandem")
    served = ServedModel.of(engine)
    unknown = UnknownFields()
    _install_error_handlers(app)
    add_info_routes(app, engine, served)
    openai = OpenAIServing(engine, served.name, served.sampling_defaults, engine.server_args.chat_metadata_format)
    add_generate_routes(app, engine, openai, unknown)
    add_control_routes(app, engine, unknown)
    add_weights_checker_route(app, engine, unknown)
    add_pull_weights_route(app, engine, engine.model_path, unknown)  # version 0: the start-up checkpoint
    add_lora_routes(app, engine, unknown)
    policy = AccessPolicy(api_key, admin_api_key)
    add_maintenance_routes(app, engine, unknown, policy)
    add_tokenize_routes(app, engine, unknown)
    args = engine.server_args
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes,
                       max_generate_bytes=args.max_generate_body_bytes,
                       max_control_bytes=args.max_control_body_bytes)
    app.add_middleware(AccessMiddleware, policy=policy,
                       origins=OriginGuard(args.allowed_origins))  # outermost
    return app


def _validation_problem(error: dict) -> str:
    """One of pydantic's errors: where in the request ("body.max_tokens") and the problem, without
    pydantic's "Value error, " before our validators' own text."""
    if error.get("type") == "json_invalid":  # FastAPI's: loc ("body", the character json.loads stopped at)
        at = error.get("loc", ("body", "?"))[-1]
        why = (error.get("ctx") or {}).get("error", "not JSON")
        return f"the body is not valid JSON ({why} at character {at}): send one JSON object"
    where = ".".join(str(p) for p in error.get("loc", ()))
    return f"{where}: {str(error.get('msg', '')).removeprefix('Value error, ')}"


def _install_error_handlers(app: FastAPI) -> None:
    from engine.api.core_client import CoreDead
    from engine.api.request_builder import GrammarUnavailable

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [_validation_problem(e) for e in exc.errors()]
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(content_type):  # curl -d sends a form's type
            parts.insert(0, f"send the body as JSON with Content-Type: application/json (got "
                            f"{content_type or 'no Content-Type'}, so it was not read as JSON)")
        return error_response("; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's "There was an error parsing the body" (a body json.loads could not take:
        not UTF-8, nested too deep, an integer too long) in the error shape of every other 400,
        saying what to send; other statuses (404, 405) as FastAPI answers them."""
        if exc.status_code == 400 and exc.detail == BODY_PARSE_DETAIL:
            return error_response("the body could not be read as JSON: send one UTF-8 JSON object, nested "
                                  "less than 1000 levels deep, with integers of at most 4300 digits")
        return await http_exception_handler(request, exc)

    @app.exception_handler(RecursionError)
    async def on_recursion_error(request: Request, _: RecursionError) -> JSONResponse:
        """A body json.loads took (under 1000 levels) whose nesting a later step could not walk
        (pickling it to the core, re-encoding a schema): the client's 400, not a 500."""
        logger.info("%s: a request nested too deeply to process", request.url.path)
        return error_response("a field of the request is nested too deeply to process (hundreds of levels); "
                              "send flatter JSON")

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, _: ClientGone) -> Response:
        logger.info("%s: the client left; its requests were aborted", request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(CoreDead)
    async def on_core_dead(_: Request, exc: CoreDead) -> JSONResponse:
        return error_response(f"the engine is not running: {exc}", 503)

    @app.exception_handler(GrammarUnavailable)
    async def on_grammar_unavailable(_: Request, exc: GrammarUnavailable) -> JSONResponse:
        return error_response(str(exc), 503)


def _is_json(content_type: str) -> bool:
    """FastAPI's rule for reading a body as JSON: application/json or application/*+json."""
    kind = content_type.split(";")[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))
