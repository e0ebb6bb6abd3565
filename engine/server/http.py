"""The HTTP server: SGLang's native routes plus the OpenAI-compatible ones, over one Engine.

Bad input comes back as 400 with SGLang's error body and the engine keeps serving. With an
api key set, every route but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server.control_routes import add_control_routes
from engine.server.metrics import metrics_text
from engine.server.openai import OpenAIServing
from engine.server.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest

logger = logging.getLogger("tandem")
OPEN_ROUTES = {"/health", "/health_generate"}


def error_response(message: str, code: int = 400) -> JSONResponse:
    kind = "Bad Request" if code == 400 else "Unauthorized" if code == 401 else "Error"
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": code}
    return JSONResponse(body, status_code=code)


def create_app(engine: Any, api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="tandem")
    model_name = engine.server_args.model_path
    openai = OpenAIServing(engine, model_name)
    _install_error_handlers(app, api_key)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": model_name, "tokenizer_path": engine.server_args.tokenizer_path or model_name,
                "is_generation": True, "weight_version": await asyncio.to_thread(engine.get_weight_version)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await asyncio.to_thread(metrics_text, engine), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> Any:
        kwargs = req.model_dump(exclude={"text", "stream"}) | {"prompt": req.text}
        if req.stream:
            stream = engine.async_generate(**kwargs, stream=True)
            return StreamingResponse(_sse(stream), media_type="text/event-stream")
        return await engine.async_generate(**kwargs)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        if req.stream:
            return StreamingResponse(openai.completion_stream(req), media_type="text/event-stream")
        return await openai.completion(req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        if req.stream:
            return StreamingResponse(openai.chat_stream(req), media_type="text/event-stream")
        return await openai.chat(req)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "tandem"}]}

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        ok = engine.flush_cache()
        msg = "Cache flushed." if ok else "Cache not flushed: requests are running."
        return Response(msg, status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> Response:
        engine.abort_request(req.rid or None, abort_all=req.abort_all)
        return Response(status_code=200)

    add_control_routes(app, engine)
    return app


async def _sse(stream: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in stream:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def _install_error_handlers(app: FastAPI, api_key: Optional[str]) -> None:
    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error_response("; ".join(parts) or "invalid request")

    if api_key is None:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Any:
        if request.url.path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given, f"Bearer {api_key}"):
                return error_response("missing or wrong api key (Authorization: Bearer <key>)", 401)
        return await call_next(request)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine import Engine
    from engine.cli.server_args import server_args_from_namespace

    engine = Engine(**server_args_from_namespace(args))
    app = create_app(engine, api_key=engine.server_args.api_key)
    logger.info("serving on http://%s:%d", engine.server_args.host, engine.server_args.port)
    try:
        uvicorn.run(app, host=engine.server_args.host, port=engine.server_args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
