"""Read-only routes: health, model and server info, weight version, loads, metrics, weights by
name. The info routes answer from the core's counters without waiting on a busy core
(Engine.recent_stats: a fresh answer within 0.2 s, else the core's last report), so a long step,
a weight load or a pending rendezvous never holds them up; none of them takes a thread of the
event loop's pool (other routes may hold those while they wait). A dead core is a 503 at once."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from engine.api.request_ids import fresh_rid
from engine.server.errors import error_response
from engine.server.metrics import GenThroughput, metrics_text
from engine.server.protocol import GetWeightsByNameRequest
from engine.server.served_model import ServedModel

# keys slime's and Miles' launchers compare against what they asked for (one GPU, one engine)
PROBE_POLL_S = 1.0  # /health_generate: how often a waiting probe looks whether the core steps
SINGLE_ENGINE_DEFAULTS = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1,
                          "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1, "num_gpus": 1,
                          "enable_memory_saver": False, "enable_return_routed_experts": False,
                          "disaggregation_mode": "null", "encoder_only": False}


def add_info_routes(app: FastAPI, engine: Any, served: ServedModel) -> None:
    started = int(time.time())
    timeout = engine.server_args.health_check_timeout

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a 1-token generation answers; 503 if the core is dead, hung or paused. Paused
        or with its memory released it says so at once (the probe would wait out its timeout)."""
        if engine.is_alive():
            try:  # a core busy in one long call answers no stats: then the probe (bounded) says
                stats = await asyncio.wait_for(engine.recent_stats(), timeout)
            except asyncio.TimeoutError:
                stats = None
            why = None if stats is None else _not_generating(stats)
            if why is not None:
                return error_response(f"not generating: {why}", 503)
        return Response(status_code=200 if await _probe(engine, timeout) else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": engine.model_path, "tokenizer_path": served.tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": (await engine.recent_stats()).weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": served.model_type, "architectures": served.architectures,
                "served_model_name": served.name}

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": (await engine.recent_stats()).weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        info = {**SINGLE_ENGINE_DEFAULTS, **engine.server_info(await engine.recent_stats())}
        # the GPUs this server holds: slime and Miles size the weight-sync group and rank offsets by it
        info["num_gpus"] = info["tp_size"] * info["pp_size"]
        return {**info, "model_path": engine.model_path}  # a disk update's since

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [served.card(started)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> Any:
        if model_id != served.name:
            body = {"message": f"The model '{model_id}' does not exist", "type": "invalid_request_error",
                    "param": "model", "code": "model_not_found"}
            return JSONResponse({"error": body}, status_code=404)
        return served.card(started)

    @app.get("/v1/loads")
    async def loads() -> dict:
        return _loads(await engine.recent_stats())

    @app.get("/get_load")
    async def get_load() -> list:
        """SGLang's legacy load route (ROLL waits until every num_reqs and num_waiting_reqs is 0)."""
        return engine.load_report(await engine.recent_stats())

    throughput = GenThroughput()

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await engine.recent_stats()
        return Response(metrics_text(stats, throughput.update(stats)), media_type="text/plain; version=0.0.4")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(req: GetWeightsByNameRequest) -> Any:
        try:
            return await asyncio.to_thread(engine.get_weights_by_name, req.name, req.truncate_size)
        except ValueError as exc:
            return error_response(f"Get parameter by name failed: {exc}")


def _not_generating(stats: Any) -> Optional[str]:
    """Why a generation would wait now (paused, memory released), or None."""
    if stats.paused:
        return "generation is paused (/continue_generation resumes it)"
    if stats.memory_released:
        return (f"its memory is released ({', '.join(stats.memory_released)}; /resume_memory_occupation "
                "brings it back)")
    return None


async def _probe(engine: Any, timeout: float) -> bool:
    if not engine.is_alive():
        return False
    rid = f"HEALTH_CHECK_{fresh_rid()}"
    steps = (await engine.recent_stats()).num_steps
    probe = asyncio.ensure_future(engine.async_generate(
        input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=rid))
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        left = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({probe}, timeout=max(min(PROBE_POLL_S, left), 0))
        if done:
            reason: Optional[dict] = probe.result()["meta_info"].get("finish_reason")
            return reason is not None and reason.get("type") != "abort"
        # as SGLang's: a core that steps is healthy though the probe waits (behind a held weight
        # update, or a full batch)
        stepping = (await engine.recent_stats()).num_steps > steps
        if stepping or left <= 0:
            engine.abort_request(rid)
            await asyncio.wait({probe}, timeout=PROBE_POLL_S)
            return stepping


def _loads(stats: Any) -> dict:
    """SGLang's /v1/loads: one entry per data-parallel rank (one here). slime sums
    num_total_reqs over `loads` until it reads 0 before a weight sync."""
    running, waiting = stats.num_running_reqs, stats.num_waiting_reqs
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": stats.kv_tokens_used,
            "max_total_num_tokens": stats.kv_tokens_total,
            "token_usage": stats.kv_tokens_used / max(stats.kv_tokens_total, 1)}
    return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "tandem",
            "loads": [load], "aggregate": {k: load[k] for k in ("num_running_reqs", "num_waiting_reqs",
                                                                 "num_total_reqs", "num_used_tokens")}}
