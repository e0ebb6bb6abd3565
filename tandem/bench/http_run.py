"""Measured passes of a workload through a running server's `/generate`, as rollout workers
send them: one HTTP request per prompt (input_ids), all at once (concurrency = requests), over
kept-alive connections. Streamed runs (SSE) give TTFT / ITL from each chunk's arrival; final
runs read one JSON answer per request. The numbers have the same keys as the in-process run's.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

from engine_client.async_http import open_client
from tandem.bench.stats import percentile
from tandem.bench.tandem_run import LATENCY_KEYS, STREAM_MODES, RunOutcome, TokenTrace, run_metrics
from tandem.bench.workload import Workload

FLUSH_RETRIES = 50  # /flush_cache refuses while requests from an earlier run are still finishing


class HttpBench:
    """One client (one connection pool) for all runs against one server."""

    def __init__(self, url: str, api_key: Optional[str] = None, admin_api_key: Optional[str] = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_api_key or api_key
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}

    def server_info(self) -> dict[str, Any]:
        resp = _import_httpx().get(f"{self.url}/get_server_info", headers=self.headers, timeout=60)
        _check(resp.status_code, resp.text, "/get_server_info")
        return resp.json()

    def run_all(self, warmup: Workload, workload: Workload, warmup_runs: int, runs: int,
                mode: str) -> list[RunOutcome]:
        """warmup_runs unmeasured runs of `warmup`, then `runs` measured runs of `workload`."""
        if mode not in STREAM_MODES:
            raise ValueError(f"stream mode must be one of {', '.join(STREAM_MODES)}; got {mode!r}")
        return asyncio.run(self._run_all(warmup, workload, warmup_runs, runs, mode))

    async def _run_all(self, warmup: Workload, workload: Workload, warmup_runs: int, runs: int,
                       mode: str) -> list[RunOutcome]:
        client = open_client(self.url, workload.num_requests + 8)
        try:
            for _ in range(warmup_runs):
                await self._measure(client, warmup, mode)
            return [await self._measure(client, workload, mode) for _ in range(runs)]
        finally:
            await client.close()

    async def _measure(self, client: Any, workload: Workload, mode: str) -> RunOutcome:
        outcome = await self._run_once(client, workload, stream=mode != "final")
        if mode == "both":
            streamed = await self._run_once(client, workload, stream=True)
            outcome.metrics.update({k: streamed.metrics[k] for k in LATENCY_KEYS})
            outcome.metrics["streamed_output_tok_s"] = streamed.metrics["output_tok_s"]
        return outcome

    async def _run_once(self, client: Any, workload: Workload, stream: bool) -> RunOutcome:
        await self._flush(client)  # each run starts cold, as the in-process runs do
        params = workload.sampling_params()
        traces = [TokenTrace() for _ in range(workload.num_requests)] if stream else None
        start = time.perf_counter()
        timed = await asyncio.gather(*[
            self._generate(client, ids, p, traces[i] if traces else None, start,
                           workload.lora_paths[i] if workload.lora_paths else None)
            for i, (ids, p) in enumerate(zip(workload.input_ids, params))])
        wall = time.perf_counter() - start
        finals = [final for final, _ in timed]
        metrics = run_metrics(workload, finals, traces, wall)
        metrics["retractions"] = None  # the server's counters are not read over HTTP
        metrics["peak_memory_gb"] = None
        metrics.update(outside_core_ms([latency for _, latency in timed], finals))
        return RunOutcome(metrics, [f["output_ids"] for f in finals])

    async def _generate(self, client: Any, input_ids: list[int], params: dict, trace: Optional[TokenTrace],
                        start: float, lora_path: Optional[str] = None) -> tuple[dict, float]:
        """The request's final output and its latency from the run's start (at its last chunk)."""
        body = {"input_ids": input_ids, "sampling_params": params, "stream": trace is not None}
        if lora_path is not None:
            body["lora_path"] = lora_path
        if trace is None:
            status, text = await client.post("/generate", body, self.headers)
            _check(status, text, "/generate")
            return json.loads(text), time.perf_counter() - start
        final: Optional[dict] = None
        async for line in client.stream_lines("/generate", body, self.headers):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            final = json.loads(line[6:])
            latency = time.perf_counter() - start
            trace.add(latency, final["meta_info"]["completion_tokens"])
        if final is None:
            raise RuntimeError("the server's /generate stream ended without a chunk")
        return final, latency

    async def _flush(self, client: Any) -> None:
        for _ in range(FLUSH_RETRIES):
            status, text = await client.post("/flush_cache", None, self.admin_headers)
            if status == 200:
                return
            if status != 400:
                _check(status, text, "/flush_cache")
            await asyncio.sleep(0.1)
        raise RuntimeError("the server would not flush its cache: requests are still running on it")


def outside_core_ms(latencies: list[float], finals: list[dict]) -> dict[str, Optional[float]]:
    """Each request's time outside the engine core: its latency at the client less the core's own
    `e2e_latency` (from the core taking it in to its last output), i.e. the way in (client, HTTP,
    server, pipe, the core's inbox) and the way out. Sent all at once, the largest is about how far
    apart the requests reached the core: the HTTP path's share of a burst's wall time."""
    outside = [lat - f["meta_info"]["e2e_latency"] for lat, f in zip(latencies, finals)
               if isinstance(f.get("meta_info", {}).get("e2e_latency"), (int, float))]
    if not outside:
        return {"outside_core_median_ms": None, "outside_core_max_ms": None}
    return {"outside_core_median_ms": 1000.0 * percentile(outside, 50), "outside_core_max_ms": 1000.0 * max(outside)}


def _check(status: int, text: str, route: str) -> None:
    if status != 200:
        raise RuntimeError(f"{route} answered {status}: {text[:500]}")


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise SystemExit("tandem bench --url needs httpx: pip install httpx") from None
    return httpx
