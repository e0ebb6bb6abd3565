"""`tandem bench --profile N`: one extra run under torch.profiler, its top N kernels by time.

Tells where a step's time goes: the kernels' share of the wall time (below 1.0 the device waits
for the host) and which kernels dominate (attention vs GEMMs vs small elementwise ones). Kernels
replayed inside CUDA graphs are reported by CUPTI like any other, from every thread (the engine's
work runs on its own thread). On a CPU the profiler sees only the calling thread's ops, not the
engine thread's, so there is nothing to report and the run is skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.bench.tandem_run import measure
from tandem.bench.workload import Workload


def profile_run(engine: Any, workload: Workload, device: torch.device, mode: str, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {"skipped": "--profile needs a CUDA device (CPU ops of the engine thread are not traced)"}
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        outcome = measure(engine, workload, device, mode)
    return {**kernel_table(prof, outcome.metrics["wall_s"], top), "output_tok_s": outcome.metrics["output_tok_s"]}


def kernel_table(prof: Any, wall_s: float, top: int) -> dict[str, Any]:
    """A finished torch.profiler run's top `top` kernels by device time, and the device's busy
    share of `wall_s`."""
    # kernels and copies: CPU-side ops have no self device time
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in events)
    rows = [{"name": e.key[:90], "calls": e.count, "total_ms": e.self_device_time_total / 1e3,
             "mean_us": e.self_device_time_total / max(e.count, 1),
             "share": e.self_device_time_total / max(total_us, 1e-9)}
            for e in events[:top]]
    return {"wall_s": wall_s, "busy_s": total_us / 1e6, "busy_share": total_us / 1e6 / wall_s, "top": rows}


def format_profile(p: dict[str, Any]) -> str:
    if "skipped" in p:
        return f"profile skipped: {p['skipped']}"
    lines = [f"profile: wall {p['wall_s']:.3f} s, kernel time {p['busy_s']:.3f} s "
             f"({100 * p['busy_share']:.0f}% of wall), {p['output_tok_s']:.0f} out tok/s",
             f"{'share':>6} {'total ms':>9} {'calls':>7} {'mean us':>8}  kernel"]
    for r in p["top"]:
        lines.append(f"{100 * r['share']:5.1f}% {r['total_ms']:9.2f} {r['calls']:7d} {r['mean_us']:8.1f}  {r['name']}")
    return "\n".join(lines)
