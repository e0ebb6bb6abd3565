"""The harness's results as a table and as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from tandem.determinism.harness import ModeResult

COLUMNS = ("mode", "trials", "unique outputs", "max |Δ logprob|", "time (s)", "result")


def format_table(results: list[ModeResult], header: str = "") -> str:
    rows = [COLUMNS] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [header] if header else []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in results:
        lines.extend(f"  {r.mode}: {line}" for line in _details(r))
    return "\n".join(lines)


def progress_line(r: ModeResult) -> str:
    return (f"[{r.mode}] {'pass' if r.passed else 'FAIL'}: {r.max_unique} unique, "
            f"max |Δ logprob| {_delta(r.max_delta)}, {r.seconds:.1f} s")


def _row(r: ModeResult) -> tuple[str, ...]:
    return (r.mode, str(r.trials), str(r.max_unique), _delta(r.max_delta), f"{r.seconds:.1f}",
            "pass" if r.passed else "FAIL")


def _details(r: ModeResult) -> list[str]:
    lines = list(r.notes) + [f"FAIL: {reason}" for reason in r.failures]
    if len(r.unique) > 1:
        lines.append("unique per prompt: " + ", ".join(f"{k}: {v}" for k, v in r.unique.items()))
    return lines


def _delta(value: float) -> str:
    return "0" if value == 0 else "inf" if math.isinf(value) else f"{value:.3g}"


def to_json(results: list[ModeResult], extra: dict[str, Any]) -> dict[str, Any]:
    modes = []
    for r in results:
        d = dataclasses.asdict(r)
        d["max_unique"] = r.max_unique
        d["max_delta"] = None if math.isinf(r.max_delta) else r.max_delta
        modes.append(d)
    return {**extra, "passed": all(r.passed for r in results), "modes": modes}


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
