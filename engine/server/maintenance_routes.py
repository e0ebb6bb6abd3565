"""Cache, abort and profiling routes (admin key): /flush_cache (GET and POST, as slime polls it
with GET), /abort_request, /start_profile, /stop_profile. Replies follow SGLang's."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from engine.server.profiler import Profiler
from engine.server.protocol import AbortRequest, StartProfileRequest, UnknownFields

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


def add_maintenance_routes(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:
    profiler = Profiler()
    tasks: set[asyncio.Task] = set()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await asyncio.to_thread(engine.flush_cache)
        return PlainTextResponse(FLUSHED if ok else "Cache not flushed: requests are running or waiting.\n",
                                 status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> Response:
        unknown.note("/abort_request", req)
        if req.abort_all:
            engine.abort_request(abort_all=True)
        for rid in [] if req.abort_all else req.rids():  # no rid and no abort_all aborts nothing
            engine.abort_request(rid)
        return Response(status_code=200)

    @app.post("/start_profile")
    async def start_profile(req: StartProfileRequest) -> Response:
        unknown.note("/start_profile", req)
        if req.num_steps is not None and req.num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {req.num_steps}")
        start = (await asyncio.to_thread(engine.get_stats)).num_steps
        await profiler.on_thread(profiler.start, req.output_dir, req.activities, req.with_stack, req.record_shapes)
        if req.num_steps:
            task = asyncio.create_task(profiler.stop_after_steps(engine, start, req.num_steps))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return PlainTextResponse("Start profiling.\n")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        path = await profiler.on_thread(profiler.stop)
        return PlainTextResponse(f"Stop profiling. This will take some time.\nTrace: {path}\n")
