"""One measured pass of a workload through the Engine, with per-token timestamps.

All requests go in at once through `Engine.async_generate(stream=True)`; each streamed chunk is
stamped on arrival, which gives time to first token (from submission) and the gaps between
tokens. Streaming has a price: one message per token per request through the core thread and
the event loop, which a fast GPU step makes visible in throughput. Hence three modes:
  stream: every run streams; throughput and latency come from the same runs;
  final:  the engine sends final results only (as a rollout worker uses it); no TTFT / ITL;
  both:   each run twice, throughput from the `final` pass, TTFT / ITL from the streamed one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from tandem.bench.stats import percentile
from tandem.bench.workload import Workload

if TYPE_CHECKING:  # torch loads with the engine, not when `tandem --help` builds the parser
    import torch

STREAM_MODES = ("stream", "final", "both")
LATENCY_KEYS = ("ttft_median_ms", "ttft_p99_ms", "itl_median_ms", "itl_p99_ms")


@dataclass
class TokenTrace:
    """Arrival times of one request's tokens (seconds from submission)."""

    first: Optional[float] = None
    gaps: list[float] = field(default_factory=list)  # one entry per token after the first
    last_time: float = 0.0
    count: int = 0

    def add(self, t: float, completion_tokens: int) -> None:
        new = completion_tokens - self.count
        if new <= 0:
            return
        if self.first is None:
            self.first = t
            new -= 1  # tokens sharing the first chunk arrived together: zero gap each
            self.gaps.extend([0.0] * new)
        else:
            self.gaps.extend([(t - self.last_time) / new] * new)
        self.count, self.last_time = completion_tokens, t


@dataclass
class RunOutcome:
    metrics: dict[str, Any]
    output_ids: list[list[int]]


def measure(engine: Any, workload: Workload, device: torch.device, mode: str) -> RunOutcome:
    """One measured run in the given stream mode (see the module docstring)."""
    if mode not in STREAM_MODES:
        raise ValueError(f"stream mode must be one of {', '.join(STREAM_MODES)}; got {mode!r}")
    outcome = run_once(engine, workload, device, stream=mode != "final")
    if mode != "both":
        return outcome
    streamed = run_once(engine, workload, device, stream=True)
    outcome.metrics.update({k: streamed.metrics[k] for k in LATENCY_KEYS})
    outcome.metrics["streamed_output_tok_s"] = streamed.metrics["output_tok_s"]
    return outcome


def run_once(engine: Any, workload: Workload, device: torch.device, stream: bool = True) -> RunOutcome:
    from tandem.bench import device as dev

    engine.flush_cache()  # each run starts cold: no hits from an earlier run's prompts
    retractions_before = engine.get_stats().num_retractions
    dev.reset_peak_memory(device)
    finals, traces, wall = asyncio.run(_submit_all(engine, workload, stream))
    metrics = run_metrics(workload, finals, traces, wall)
    metrics["retractions"] = engine.get_stats().num_retractions - retractions_before
    metrics["routed_experts_returned"] = sum(1 for f in finals if f["meta_info"].get("routed_experts"))
    # a core in its own process holds the device memory there, out of this process's counters
    metrics["peak_memory_gb"] = None if engine.server_args.core_process else dev.peak_memory_gb(device)
    return RunOutcome(metrics, [f["output_ids"] for f in finals])


async def _submit_all(engine: Any, workload: Workload, stream: bool):
    params = workload.sampling_params()
    # an engine started to return routed experts (MoE) returns them for every request: that is its cost
    routes = bool(getattr(engine.server_args, "enable_return_routed_experts", False))
    start = time.perf_counter()
    gen = engine.async_generate(input_ids=workload.input_ids, sampling_params=params, stream=stream,
                                return_routed_experts=routes, lora_path=workload.lora_paths)
    if not stream:
        finals = await gen
        return finals, None, time.perf_counter() - start
    traces = [TokenTrace() for _ in range(workload.num_requests)]
    finals: list[Optional[dict]] = [None] * workload.num_requests
    async for chunk in gen:
        i = chunk["index"]
        traces[i].add(time.perf_counter() - start, chunk["meta_info"]["completion_tokens"])
        finals[i] = chunk  # chunks are cumulative: the last one is the final result
    return finals, traces, time.perf_counter() - start


def run_metrics(workload: Workload, finals: list[dict], traces: Optional[list[TokenTrace]],
             wall: float) -> dict[str, Any]:
    metas = [f["meta_info"] for f in finals]
    out_tokens = sum(m["completion_tokens"] for m in metas)
    in_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    ttft = [t.first for t in traces if t.first is not None] if traces else []
    itl = [g for t in traces for g in t.gaps] if traces else []
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tok_s": out_tokens / wall,
        "input_tok_s": in_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
        "ttft_median_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_median_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "cache_hit_rate": cached / in_tokens if in_tokens else 0.0,
        "cached_tokens": cached,
        "not_length_finished": sum(1 for m in metas if (m["finish_reason"] or {}).get("type") != "length"),
        "expected_output_tokens": workload.total_output_tokens,
    }


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0
