"""Prometheus metrics for /metrics, from the core's counters at scrape time (a StatsSnapshot): tandem's
own families, and the SGLang names dashboards built for SGLang read (Miles' dashboard, Grafana's
SGLang boards: `sglang:num_running_reqs`, `sglang:gen_throughput`, `sglang:token_usage`, ...)."""

from __future__ import annotations

from typing import Any, Optional

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
        yield CounterMetricFamily("tandem_generation_tokens", "tokens generated (a request's first one by its prefill)",
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
        yield GaugeMetricFamily("tandem_kv_token_usage", "share of KV slots in use or cached", value=_kv_usage(stats))


class SGLangNamesCollector:
    """The snapshot under SGLang's metric names (their values computed as SGLang does)."""

    def __init__(self, stats: Any, gen_throughput: float):
        self.stats, self.gen_throughput = stats, gen_throughput

    def collect(self):
        s = self.stats
        prompt_tokens = s.num_prefill_tokens + s.num_cached_tokens
        yield GaugeMetricFamily("sglang:num_running_reqs", "The number of running requests.", value=s.num_running_reqs)
        yield GaugeMetricFamily("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                                value=s.num_waiting_reqs)
        yield GaugeMetricFamily("sglang:token_usage", "The token usage.", value=_kv_usage(s))
        yield GaugeMetricFamily("sglang:num_used_tokens", "The number of used tokens.", value=s.kv_tokens_used)
        yield GaugeMetricFamily("sglang:cache_hit_rate", "The prefix cache hit rate.",
                                value=s.num_cached_tokens / max(prompt_tokens, 1))
        yield GaugeMetricFamily("sglang:gen_throughput", "The generation throughput (token/s).",
                                value=self.gen_throughput)
        yield CounterMetricFamily("sglang:prompt_tokens", "Number of prefill tokens processed.", value=prompt_tokens)
        yield CounterMetricFamily("sglang:generation_tokens", "Number of generation tokens processed.",
                                  value=s.num_generated_tokens)
        yield CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens.", value=s.num_cached_tokens)


class GenThroughput:
    """Generated tokens a second between two scrapes (SGLang's gen_throughput: its last interval)."""

    MIN_INTERVAL_S = 1.0  # scrapes closer than this keep the last rate (two scrapers would halve the window)

    def __init__(self) -> None:
        self._last: Optional[tuple[float, int]] = None
        self._rate = 0.0

    def update(self, stats: Any) -> float:
        now, tokens = stats.uptime_s, stats.num_generated_tokens
        if self._last is None or tokens < self._last[1] or now < self._last[0]:  # first scrape, or a new core
            self._last = (now, tokens)
        elif now - self._last[0] >= self.MIN_INTERVAL_S:
            self._rate = (tokens - self._last[1]) / (now - self._last[0])
            self._last = (now, tokens)
        return self._rate


def _kv_usage(stats: Any) -> float:
    return stats.kv_tokens_used / max(stats.kv_tokens_total, 1)


def metrics_text(stats: Any, gen_throughput: float = 0.0) -> bytes:
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats))
    registry.register(SGLangNamesCollector(stats, gen_throughput))
    return generate_latest(registry)
