"""Cache, abort and profiling routes: /flush_cache (GET and POST, as slime polls it with GET),
/abort_request (by rid with either key; abort_all with the admin key), /start_profile,
/stop_profile, /freeze_gc (admin key). Replies follow SGLang's."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from functools import partial
from typing import Any, Callable, Coroutine, Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from engine.server.access import AccessPolicy, authorization
from engine.server.errors import error_response
from engine.server.profiler import Profiler
from engine.server.protocol import AbortRequest, StartProfileRequest, UnknownFields

logger = logging.getLogger("tandem")
FLUSH_RETRY_S = 0.05
FLUSH_TIMEOUT_MAX_S = 3600.0
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")


def add_maintenance_routes(app: FastAPI, engine: Any, unknown: UnknownFields, policy: AccessPolicy) -> None:
    profiler = Profiler()
    tasks: set[asyncio.Task] = set()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: Optional[str] = None) -> Response:
        """SGLang 0.5.23's ?timeout=S: retried until the running and waiting requests are gone, for
        up to S seconds (without it, one try)."""
        wait_s = _flush_timeout(timeout)
        if isinstance(wait_s, Response):
            return wait_s
        deadline = time.monotonic() + wait_s
        while not (ok := await asyncio.to_thread(engine.flush_cache)) and time.monotonic() < deadline:
            await asyncio.sleep(min(FLUSH_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        waited = f" within {wait_s:g} s" if wait_s else ""
        return PlainTextResponse(FLUSHED if ok else f"Cache not flushed: requests are running or waiting{waited}.\n",
                                 status_code=200 if ok else 400)

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc() -> Response:
        await asyncio.to_thread(engine.freeze_gc)
        return PlainTextResponse("Garbage collection frozen.\n")

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest, request: Request) -> Response:
        unknown.note("/abort_request", req)
        if req.abort_all and not policy.is_admin(authorization(request.scope)):
            return error_response("abort_all ends every client's requests: it needs the admin api key "
                                  "(Authorization: Bearer <admin key>); abort your own by rid", 401)
        if req.abort_all:
            engine.abort_request(abort_all=True)
        for rid in [] if req.abort_all else req.rids():  # no rid and no abort_all aborts nothing
            engine.abort_request(rid, prefix=req.prefix)
        return Response(status_code=200)

    @app.post("/start_profile")
    async def start_profile(req: StartProfileRequest) -> Response:
        unknown.note("/start_profile", req)
        if req.profile_by_stage:
            raise ValueError("profile_by_stage is not supported: tandem traces prefill and decode steps together "
                             "(leave it false)")
        Profiler.check_activities(req.activities)
        profiler.check_output_dir(req.output_dir)  # answered now, not logged after a 200
        steps = (await asyncio.to_thread(engine.get_stats)).num_steps
        start = partial(profiler.start, req.output_dir, req.activities, req.with_stack, req.record_shapes)
        token = profiler.schedule()  # no await before it: a concurrent start is refused from here on
        if not req.start_step:
            await profiler.start_now(token, start)
        work = _profile_steps(profiler, engine, steps, req.start_step or 0, req.num_steps, start, token, profiler.profile)
        _in_background(tasks, work)
        return PlainTextResponse("Start profiling.\n")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        path = await profiler.on_thread(profiler.stop)
        return PlainTextResponse(f"Stop profiling. This will take some time.\nTrace: {path}\n")


async def _profile_steps(profiler: Profiler, engine: Any, steps: int, start_step: int, num_steps: Optional[int],
                         start: Callable[[], None], token: object, profile: Any) -> None:
    """SGLang's step-bounded profile: the start waits for start_step more forward passes (when 0
    it was made already: `profile`), the stop comes num_steps passes after it (never, when None)."""
    try:
        if start_step:
            if not await profiler.start_after_steps(engine, token, steps + start_step, start):
                return  # /stop_profile came first
            steps, profile = (await asyncio.to_thread(engine.get_stats)).num_steps, profiler.profile
        if num_steps:
            await profiler.stop_after_steps(engine, profile, steps, num_steps)
    except Exception:  # nobody waits for this task: say why the trace is missing
        logger.exception("the step-bounded profile failed")


def _in_background(tasks: set[asyncio.Task], work: Coroutine) -> None:
    task = asyncio.create_task(work)
    tasks.add(task)  # held until done: the loop keeps only weak references
    task.add_done_callback(tasks.discard)


def _flush_timeout(raw: Optional[str]) -> Any:
    """/flush_cache's ?timeout as seconds (0 without it), or the 400 naming what is wrong."""
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= FLUSH_TIMEOUT_MAX_S:  # NaN fails too
        return PlainTextResponse(f"timeout must be a number of seconds from 0 to {FLUSH_TIMEOUT_MAX_S:g}; "
                                 f"got {raw!r}\n", status_code=400)
    return seconds
