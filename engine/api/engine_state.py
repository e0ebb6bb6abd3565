"""EngineState: Engine's read-only verbs: the core's counters, SGLang's /get_load and
/get_server_info, the pool's integrity check, and freezing the garbage collector. Mixed into
Engine, which supplies `client`, `info`, `server_args`, `_call`, `_lock` and `_sinks`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

from engine.api.core_client import CoreClient
from engine.config import ServerArgs
from engine.core.messages import CheckIntegrityReq, CoreInfo, FreezeGCReq, StatsReq, StatsSnapshot
from engine.gc_freeze import freeze_gc
from engine.lora.lora_paths import lora_refs

STATS_WAIT_S = 0.2  # how long an info route waits for the core's fresh counters before using its last report


class EngineState:
    client: CoreClient
    info: CoreInfo
    server_args: ServerArgs
    local_core: Any
    _lock: threading.Lock
    _sinks: dict
    _stats_call: Optional[Future]

    def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    def get_stats(self) -> StatsSnapshot:
        return self._call(StatsReq())

    def get_load(self) -> list[dict[str, Any]]:
        return self.load_report(self.get_stats())

    def load_report(self, stats: StatsSnapshot) -> list[dict[str, Any]]:
        """SGLang's /get_load: a dict per data-parallel rank (one here). num_reqs is this front end's
        own count of requests in flight, exact whatever the core is doing; the waiting count and KV
        tokens are from `stats` (the HTTP route's: recent_stats, never held up by a busy core)."""
        with self._lock:
            in_flight = len(self._sinks)
        return [{"dp_rank": 0, "num_reqs": in_flight, "num_waiting_reqs": min(stats.num_waiting_reqs, in_flight),
                 "num_tokens": stats.kv_tokens_used, "ts_tic": time.perf_counter()}]

    async def recent_stats(self, wait_s: float = STATS_WAIT_S) -> StatsSnapshot:
        """The core's counters for read-only routes, never held up by a busy core: its answer if
        it comes within wait_s, else the counters it last reported (engine/core/worker.py). At
        most one such call waits on the core at a time."""
        call = self._stats_call
        if call is None or call.done():
            call = self._stats_call = self.client.call_future(StatsReq())  # CoreDead: the route's 503
        done, _ = await asyncio.wait({asyncio.wrap_future(call)}, timeout=wait_s)
        if done:
            return done.pop().result()
        latest = self.client.latest_stats
        return latest if latest is not None else await asyncio.wrap_future(call)

    def get_server_info(self) -> dict[str, Any]:
        return self.server_info(self.get_stats())

    def server_info(self, stats: StatsSnapshot) -> dict[str, Any]:
        """SGLang's shape: the server args, the derived limits and the internal states. lora_paths
        as SGLang normalises it: LoRARef records with LoRA on, else null."""
        info = self.info
        args = self.server_args
        return {
            **args.to_dict(), "lora_paths": lora_refs(args.lora_paths) if args.enable_lora else None,
            "version": _version(), "weight_version": stats.weight_version,
            "max_total_num_tokens": info.max_total_num_tokens, "context_len": info.context_len,
            "chunked_prefill_size": info.chunked_prefill_size, "max_running_requests": info.max_running_requests,
            "vocab_size": info.vocab_size, "device": info.device, "dtype": info.dtype,
            "attention_backend": info.attention_backend,
            "internal_states": [{"num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                                 "paused": stats.paused, "memory_released": list(stats.memory_released),
                                 "kv_token_usage": stats.kv_tokens_used / max(stats.kv_tokens_total, 1)}],
        }

    def check_integrity(self) -> None:
        """Asserts free + cached + in use == pool size (checked on the core)."""
        self._call(CheckIntegrityReq())

    def freeze_gc(self) -> None:
        """SGLang's freeze_gc: the objects alive now are never scanned by the garbage collector
        again (engine/gc_freeze.py), in this process and in the core's own process when it has one
        (which froze its start-up objects already). `tandem serve` calls it once ready; an
        in-process engine leaves the choice to its host program."""
        if self.local_core is None:
            self._call(FreezeGCReq())
        freeze_gc("front end")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tandem")
    except Exception:
        return "0.1.0"
