"""The RL control routes: pause / continue generation, weight updates, weight version.

Bodies and replies follow SGLang's (shared/reference/sglang-rl-api.md 1.5, 1.6, 1.9), so RL
clients written for it work unchanged. Each call blocks until the core thread has run it between
two steps, so it runs off the event loop. These routes take the admin key (engine/server/access.py).
A payload that cannot be decoded is a 400 naming the problem, never a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.server.protocol import (BeginWeightUpdateRequest, DestroyWeightsUpdateGroupRequest,
                                    InitWeightsUpdateGroupRequest,
                                    MemoryOccupationRequest, PauseGenerationRequest, PostProcessWeightsRequest,
                                    UnknownFields,
                                    UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest,
                                    UpdateWeightsFromTensorRequest, UpdateWeightVersionRequest,
                                    WeightsCheckerRequest)
from weight_sync.cuda_ipc import PAYLOAD_ERRORS


def add_control_routes(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest) -> dict:
        unknown.note("/pause_generation", req)
        await asyncio.to_thread(engine.pause_generation, req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await asyncio.to_thread(engine.continue_generation)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        unknown.note("/update_weights_from_disk", req)
        _abort_all_first(engine, req)
        ok, message, paused = await asyncio.to_thread(engine.update_weights_from_disk, req.model_path,
                                                      req.load_format, req.weight_version, req.flush_cache)
        return _reply(ok, message, num_paused_requests=paused)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest) -> JSONResponse:
        """Tensors by reference (weight_sync.cuda_ipc): the sender is on this machine and keeps
        them alive until this returns. Unpickled through the allowlist only."""
        unknown.note("/update_weights_from_tensor", req)
        if not req.serialized_named_tensors:
            raise ValueError("serialized_named_tensors is empty: send one payload per rank")
        _abort_all_first(engine, req)

        def load() -> tuple[bool, str]:  # unpickled by the core itself (a core process opens the IPC handles)
            try:
                return engine.update_weights_from_serialized(req.serialized_named_tensors[0], req.load_format,
                                                             req.flush_cache, req.weight_version)
            except PAYLOAD_ERRORS as exc:  # not bytes/text, unknown load_format
                return False, _payload_error(exc)

        ok, message = await asyncio.to_thread(load)
        return _reply(ok, message)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        unknown.note("/init_weights_update_group", req)
        ok, message = await asyncio.to_thread(
            engine.init_weights_update_group, req.master_address, req.master_port, req.rank_offset,
            req.world_size, req.group_name, req.backend, req.timeout_s)
        return _reply(ok, message)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        unknown.note("/update_weights_from_distributed", req)
        _abort_all_first(engine, req)
        ok, message = await asyncio.to_thread(
            engine.update_weights_from_distributed, req.names, req.dtypes, req.shapes, req.group_name,
            flush_cache=req.flush_cache, load_format=req.load_format, weight_version=req.weight_version)
        return _reply(ok, message)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        ok, message = await asyncio.to_thread(engine.destroy_weights_update_group, req.group_name)
        return _reply(ok, message)

    @app.post("/begin_weight_update")
    async def begin_weight_update(req: BeginWeightUpdateRequest) -> JSONResponse:
        """SGLang 0.5.23's session around a sync: the Engine's (engine/api/weight_session.py)."""
        unknown.note("/begin_weight_update", req)
        return _reply(*engine.begin_weight_update(req.selector))

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        return _reply(*engine.end_weight_update())

    @app.post("/post_process_weights")
    async def post_process_weights(req: Optional[PostProcessWeightsRequest] = None) -> JSONResponse:
        """slime's and Miles' patched SGLang calls this around a sync of quantized (FP8/FP4) weights.
        tandem serves weights as loaded, with no quantized or repacked forms, so there is nothing to
        restore or rebuild; the call succeeds and their syncs go on."""
        if req is not None:
            unknown.note("/post_process_weights", req)
        return _reply(True, "nothing to post-process: weights are served as loaded (no quantized or packed forms)")

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest) -> dict:
        _abort_all_first(engine, req)
        version = await asyncio.to_thread(engine.update_weight_version, req.new_version)
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: Optional[MemoryOccupationRequest] = None) -> JSONResponse:
        """Free GPU memory by tag for a colocated trainer; requests wait until everything is resumed."""
        return await _memory_call(engine.release_memory_occupation, req)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: Optional[MemoryOccupationRequest] = None) -> JSONResponse:
        return await _memory_call(engine.resume_memory_occupation, req)


def add_weights_checker_route(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:
    @app.post("/weights_checker")
    async def weights_checker(req: Optional[WeightsCheckerRequest] = None) -> JSONResponse:
        """Miles' --check-weight-update-equal: snapshot, reset_tensors, (sync), compare; 400 when a
        tensor differs. checksum replies in SGLang's per-rank shape (one rank here)."""
        req = req or WeightsCheckerRequest()
        unknown.note("/weights_checker", req)
        result = await asyncio.to_thread(engine.check_weights, req.action, req.skip_tensor_list, req.allow_quant_error)
        if req.action == "checksum":
            sums = result.pop("checksums")
            rank_sum = hashlib.sha256("".join(f"{k}:{v}" for k, v in sorted(sums.items())).encode()).hexdigest()[:16]
            result["ranks"] = [{"checksums": sums, "per_gpu_checksum": rank_sum,
                                "parallelism_info": [{"role": "tp", "tp_rank": 0, "tp_size": 1, "rank": 0, "size": 1}]}]
            result["per_engine_checksum"] = rank_sum
        return _reply(result.pop("success"), result.pop("message"), **result)


async def _memory_call(verb: Callable[..., tuple[bool, str]], req: Optional[MemoryOccupationRequest]) -> JSONResponse:
    tags = (req.tags if req is not None else None) or None  # SGLang: none or [] means every tag
    try:
        ok, message = await asyncio.to_thread(verb, tags)
    except ValueError as exc:  # an unknown tag
        ok, message = False, str(exc)
    return _reply(ok, message)


def _abort_all_first(engine: Any, req: Any) -> None:
    """SGLang's abort_all_requests: queued ahead of the update on the core's inbox."""
    if req.abort_all_requests:
        engine.abort_request(abort_all=True)


def _payload_error(exc: Exception) -> str:
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "the payload is nested too deeply to decode"
    return f"the payload could not be decoded ({type(exc).__name__}: {exc}); send what weight_sync.cuda_ipc.serialize makes"


def _reply(ok: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)
