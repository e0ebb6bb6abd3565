"""CoreStats: the core's step counters, read by /metrics and get_server_info (StatsSnapshot)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

from engine.scheduler.batch import ScheduleBatch


@dataclass
class CoreStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_lookahead_steps: int = 0  # decode steps launched before the previous step was read
    num_mixed_steps: int = 0  # prefill passes that carried decode rows (--enable-mixed-chunk)
    started: float = field(default_factory=time.perf_counter)

    def counters(self) -> dict[str, int]:
        """Every count by its name, which StatsSnapshot shares."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "started"}

    def record(self, batch: ScheduleBatch, generated: int) -> None:
        """`generated`: the tokens the step added to outputs (a prefill's first token included, as
        SGLang's generation_tokens_total counts a request's completion tokens)."""
        self.num_steps += 1
        self.num_generated_tokens += generated
        if not batch.forward_mode.is_decode:
            n = batch.num_prefill_rows
            self.num_prefill_tokens += sum(batch.extend_lens[:n])
            # a row's prefix is the radix cache's only in its request's first chunk: later chunks'
            # prefixes are the request's own earlier chunks (prefix_len > cached_tokens there)
            self.num_cached_tokens += sum(p for r, p in zip(batch.reqs[:n], batch.prefix_lens[:n])
                                          if p == r.cached_tokens)
            self.num_mixed_steps += batch.num_decode_rows > 0
