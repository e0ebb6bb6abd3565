"""`/pull_weights`: slime's disk-delta weight sync, the engine's half.

slime (`--update-weight-local-checkpoint-dir`, its SGLang patch) asks each engine to bring a
host-local checkpoint up to a published version (weight_sync/local_checkpoint.py), then reloads it
with `/update_weights_from_disk`. The pull is file work only: it runs on a worker thread and the
engine keeps generating. Version 0 is the checkpoint the server started from. An admin route.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.server.protocol import PullWeightsRequest, UnknownFields

logger = logging.getLogger("tandem")


def add_pull_weights_route(app: FastAPI, engine: Any, start_model_path: str, unknown: UnknownFields) -> None:
    hook = getattr(getattr(engine, "server_args", None), "custom_pull_weights_pre_read_hook", None)

    @app.post("/pull_weights")
    async def pull_weights(req: PullWeightsRequest) -> JSONResponse:
        from weight_sync.local_checkpoint import pull

        unknown.note("/pull_weights", req)
        try:
            await asyncio.to_thread(pull, req.local_checkpoint_dir, start_model_path, req.source_dir,
                                    req.target_version, hook)
        except Exception as e:  # a bad publication or path: the client's to fix, named in the reply
            logger.error("/pull_weights to version %s failed: %s", req.target_version, e)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": "Success."})
