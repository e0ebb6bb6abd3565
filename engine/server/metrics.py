"""Prometheus metrics for /metrics, read from the engine's counters at scrape time."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """Reads counters when scraped, so the hot loop never pays for metrics."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self):
        core = self.engine.core
        stats, sched = core.stats, core.scheduler
        yield CounterMetricFamily("tandem_prompt_tokens", "prompt tokens computed (cache misses)",
                                  value=stats.num_prefill_tokens)
        yield CounterMetricFamily("tandem_cached_tokens", "prompt tokens served from the radix cache",
                                  value=stats.num_cached_tokens)
        yield CounterMetricFamily("tandem_generation_tokens", "tokens produced by decode steps",
                                  value=stats.num_generated_tokens)
        yield CounterMetricFamily("tandem_forward_steps", "forward passes run", value=stats.num_steps)
        yield CounterMetricFamily("tandem_retractions", "requests retracted when KV ran out",
                                  value=sched.num_retractions)
        yield GaugeMetricFamily("tandem_num_running_reqs", "requests decoding", value=len(sched.running))
        yield GaugeMetricFamily("tandem_num_waiting_reqs", "requests queued", value=len(sched.waiting))
        yield GaugeMetricFamily("tandem_new_token_ratio", "admission forecast ratio", value=sched.new_token_ratio)
        control = core.control
        yield CounterMetricFamily("tandem_weight_updates", "weight loads (one per bucket or checkpoint)",
                                  value=control.num_updates)
        yield CounterMetricFamily("tandem_weight_update_seconds", "engine time in weight loads (receive, load, flush)",
                                  value=control.update_seconds)
        yield GaugeMetricFamily("tandem_generation_paused", "1 while pause_generation holds", value=float(core.paused))
        version = GaugeMetricFamily("tandem_weight_version", "the loaded weight version (as a label)",
                                    labels=["version"])
        version.add_metric([core.weight_version], 1.0)
        yield version
        used = sched.allocator.size - sched.allocator.available_size()
        yield GaugeMetricFamily("tandem_kv_token_usage", "share of KV slots in use or cached",
                                value=used / max(sched.allocator.size, 1))


def metrics_text(engine: Any) -> bytes:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return generate_latest(registry)
