"""Prometheus metrics for /metrics, from the core's counters at scrape time (a StatsSnapshot)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """The counters of one snapshot, taken when scraped, so the hot loop never pays for metrics."""

    def __init__(self, stats: Any):
        self.stats = stats

    def collect(self):
        stats = self.stats
        yield CounterMetricFamily("tandem_prompt_tokens", "prompt tokens computed (cache misses)",
                                  value=stats.num_prefill_tokens)
        yield CounterMetricFamily("tandem_cached_tokens", "prompt tokens served from the radix cache",
                                  value=stats.num_cached_tokens)
        yield CounterMetricFamily("tandem_generation_tokens", "tokens produced by decode steps",
                                  value=stats.num_generated_tokens)
        yield CounterMetricFamily("tandem_forward_steps", "forward passes run", value=stats.num_steps)
        yield CounterMetricFamily("tandem_retractions", "requests retracted when KV ran out",
                                  value=stats.num_retractions)
        yield GaugeMetricFamily("tandem_num_running_reqs", "requests decoding", value=stats.num_running_reqs)
        yield GaugeMetricFamily("tandem_num_waiting_reqs", "requests queued", value=stats.num_waiting_reqs)
        yield GaugeMetricFamily("tandem_new_token_ratio", "admission forecast ratio", value=stats.new_token_ratio)
        yield CounterMetricFamily("tandem_weight_updates", "weight loads (one per bucket or checkpoint)",
                                  value=stats.num_weight_updates)
        yield CounterMetricFamily("tandem_weight_update_seconds", "engine time in weight loads (receive, load, flush)",
                                  value=stats.weight_update_seconds)
        yield GaugeMetricFamily("tandem_generation_paused", "1 while pause_generation holds", value=float(stats.paused))
        yield GaugeMetricFamily("tandem_memory_released", "1 while any memory is released for a colocated trainer",
                                value=float(bool(stats.memory_released)))
        version = GaugeMetricFamily("tandem_weight_version", "the loaded weight version (as a label)",
                                    labels=["version"])
        version.add_metric([stats.weight_version], 1.0)
        yield version
        yield GaugeMetricFamily("tandem_kv_token_usage", "share of KV slots in use or cached",
                                value=stats.kv_tokens_used / max(stats.kv_tokens_total, 1))


def metrics_text(stats: Any) -> bytes:
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats))
    return generate_latest(registry)
