"""PhaseClock: seconds per named phase of one piece of work, for its one log line.

Start-up (engine/core/startup_clock.py) and a colocated release / resume (engine/core/control.py)
say where their time goes this way: a slow phase is named in the log instead of guessed at.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseClock:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def breakdown(self, digits: int = 1) -> str:
        """e.g. "weights 3.0, kv_pool 0.2": the phases in the order they first ran."""
        return ", ".join(f"{name} {seconds:.{digits}f}" for name, seconds in self.phases.items())
