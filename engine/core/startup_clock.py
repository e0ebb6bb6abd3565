"""StartupClock: where an engine's start-up time goes, for its one ready line.

`tandem serve` on a fresh machine took 60 s to ready for the 8B shape where the in-process engine
took 12 s (issue 25): the phases (imports before the engine started, weights, KV pool, tokenizer,
the runner's CUDA graphs and warm-up) say which to attack. Imports are the process's age when the
engine began: Linux's process start time, else unknown.
"""

from __future__ import annotations

import os
from typing import Optional

from engine.phase_clock import PhaseClock


# The process's age when a spawned core reached its own code (the interpreter and multiprocessing's
# set-up done, nothing of torch imported yet): None in a process that did not say (mark_entry)
_entry_age_s: Optional[float] = None


def mark_entry() -> None:
    """Called first in a spawned core process: its "before engine" time then splits into the
    process's spawn and the imports that follow."""
    global _entry_age_s
    _entry_age_s = process_age_s()


class StartupClock(PhaseClock):
    def __init__(self) -> None:
        super().__init__()
        self.before_engine_s = process_age_s()
        self.spawn_s = _entry_age_s

    def summary(self) -> str:
        """e.g. "startup=12.3s (before engine 4.1 (spawn 0.3), weights 3.0, kv_pool 0.2, tokenizer 0.4, runner 4.5)"."""
        parts = [] if self.before_engine_s is None else [f"before engine {self.before_engine_s:.1f}"]
        if parts and self.spawn_s is not None:
            parts[0] += f" (spawn {self.spawn_s:.1f})"
        parts += [self.breakdown()] if self.phases else []
        return f"startup={self.elapsed():.1f}s ({', '.join(parts)})"


def process_age_s() -> Optional[float]:
    """Seconds since this process started (imports, argument parsing...); None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime
    return max(uptime - started_after_boot, 0.0)
