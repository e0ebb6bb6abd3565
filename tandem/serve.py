"""`tandem serve`: build the Engine, then run the HTTP app under uvicorn.

Keys come from --api-key / --admin-api-key or, so they stay out of the process list, from
TANDEM_API_KEY / TANDEM_ADMIN_API_KEY. Binding beyond localhost without keys logs a loud
warning. SIGTERM (or Ctrl-C) ends every request in flight with an abort, so waiting clients get
an answer, and the process exits within a few seconds even if the core is stuck.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import threading
from typing import Any, Optional

import uvicorn

logger = logging.getLogger("tandem")
KEY_ENV = {"api_key": "TANDEM_API_KEY", "admin_api_key": "TANDEM_ADMIN_API_KEY"}
LOCAL_HOSTS = ("localhost", "::1")
SHUTDOWN_GRACE_S = 3.0


def with_env_keys(kwargs: dict[str, Any], environ: Any = os.environ) -> dict[str, Any]:
    """Keys not given as flags are read from the environment."""
    out = dict(kwargs)
    for field, env in KEY_ENV.items():
        if not out.get(field) and environ.get(env):
            out[field] = environ[env]
    return out


def default_core_process(kwargs: dict[str, Any]) -> dict[str, Any]:
    """On a GPU the server runs the core in its own process unless told otherwise: measured on
    the H200 (Qwen3-0.6B shape, 256 concurrent /generate, 512/256) it serves 0.90x (64
    concurrent: 0.88x) the in-process throughput, against 0.85x with the core on a thread of the HTTP
    process (docs/benchmarks.md)."""
    if kwargs.get("core_process") is not None:
        return kwargs
    on_gpu = kwargs.get("device", "auto") in ("auto", "cuda") and cuda_available()
    return {**kwargs, "core_process": on_gpu}


def cuda_available() -> bool:
    """Whether a GPU is visible, asked of NVML first (as torch's PYTORCH_NVML_BASED_CUDA_CHECK does):
    importing torch to ask takes seconds on a fresh machine, and the core process (spawned early,
    see _spawn_core_early) should not wait for it; torch answers where NVML is not there."""
    count = nvml_gpu_count()
    if count is not None:
        return count > 0
    import torch

    return torch.cuda.is_available()


def nvml_gpu_count(environ: Any = os.environ, library: str = "libnvidia-ml.so.1") -> Optional[int]:
    """GPUs NVML sees (0 when CUDA_VISIBLE_DEVICES hides them all); None without NVML."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # CUDA reads the list up to its first invalid entry: none valid, no GPU
        first = visible.split(",")[0].strip()
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):
            return 0
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def _spawn_core_early(kwargs: dict[str, Any]) -> Any:
    """The core's process, started now when the core runs in one, so that its imports, weight load
    and CUDA graphs overlap this process's imports (the engine, transformers, fastapi) instead of
    following them; None for a core on a thread here."""
    if not kwargs.get("core_process"):
        return None
    from engine.api.core_spawn import spawn_core
    from engine.config import ServerArgs

    return spawn_core(ServerArgs.from_kwargs(**kwargs))


def exposure_warning(host: str, api_key: Any, admin_api_key: Any) -> str:
    """The warning to log for this bind, or '' when the server is local or fully keyed."""
    if host in LOCAL_HOSTS or host.startswith("127."):
        return ""
    open_parts = []
    if not api_key:
        open_parts.append("generation (set --api-key or TANDEM_API_KEY)")
    if not (admin_api_key or api_key):
        open_parts.append("control: pause, weight updates, abort (set --admin-api-key or TANDEM_ADMIN_API_KEY)")
    if not open_parts:
        return ""
    return (f"!!! SERVING ON {host} WITHOUT KEYS: anyone who can reach this port can use "
            + "; ".join(open_parts) + " !!!")


def run_serve(args: argparse.Namespace) -> int:
    from tandem.server_args import server_args_from_namespace

    kwargs = default_core_process(with_env_keys(server_args_from_namespace(args)))
    spawned = _spawn_core_early(kwargs)
    try:
        from engine import Engine
        from engine.server.http import create_app

        engine = Engine(spawned_core=spawned, **kwargs)
    except BaseException:
        if spawned is not None:
            spawned.kill()
        raise
    sa = engine.server_args
    warning = exposure_warning(sa.host, sa.api_key, sa.admin_api_key)
    if warning:
        logger.warning(warning)
    app = create_app(engine, api_key=sa.api_key, admin_api_key=sa.admin_api_key)
    config = uvicorn.Config(app, host=sa.host, port=sa.port, log_level="warning",
                            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S))
    logger.info("serving on http://%s:%d", sa.host, sa.port)
    try:
        engine.freeze_gc()  # as SGLang after warm-up: no full collection walks start-up's objects again
        GracefulServer(config, engine).run()
    finally:
        _shutdown_bounded(engine, SHUTDOWN_GRACE_S)
    return 0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that, on SIGTERM/SIGINT, first ends every request in flight (waiting,
    paused or running) with an abort, so their connections close and shutdown does not hang."""

    def __init__(self, config: Any, engine: Any) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("signal %s: ending the requests in flight and shutting down", sig)
            # on a thread: this runs inside a signal handler, which may have interrupted the main
            # thread while it held the engine's lock
            threading.Thread(target=self._end_requests, name="tandem-end-requests", daemon=True).start()
        super().handle_exit(sig, frame)

    def _end_requests(self) -> None:
        self.engine.fail_all_requests("the server is shutting down")
        self.engine.abort_request(abort_all=True)


def _shutdown_bounded(engine: Any, seconds: float) -> None:
    """engine.shutdown() waits for the core; a stuck core (a rendezvous, a hung payload) must not
    keep the process alive, and the core thread is a daemon."""
    stopper = threading.Thread(target=engine.shutdown, name="tandem-shutdown", daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        logger.warning("the engine core did not stop within %.0f s; exiting anyway", seconds)
