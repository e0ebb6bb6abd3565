"""The soak: `tandem serve` (CPU, tiny model) under mixed load for a given time, then its checks.

    python scripts/soak.py --minutes 30 --out /tmp/soak

Load (tests/soak/): streamed and unstreamed /generate and chat requests with random sampling,
clients that leave mid-stream, constrained requests (regex, json_schema), aborts by rid and of
all, pauses in every mode with continue, weight updates from disk and from tensors, flushes,
malformed bodies. Every 10 s: the server's RSS and KV usage (report.json, samples.csv). Fails
(exit 1) on any 5xx, any request without an answer within its timeout, KV left in use, a greedy
output other than a fresh engine's on the final weights, RSS growth, or, when the run is >= 20
minutes, RSS or KV usage of the last 10 minutes more than 10% over minutes 5-10. docs/soak.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "soak"))

from soak_run import run_soak  # noqa: E402


def summary(report: dict) -> list[str]:
    samples = report["samples"]
    statuses = report["statuses"]
    five_xx = sum(n for status, n in statuses.items() if status.isdigit() and int(status) >= 500)
    return [
        f"[soak] {report['minutes']} min, {report['requests']} requests, statuses {statuses}",
        f"[soak] 5xx: {five_xx}  stuck (no answer in time): {statuses.get('stuck', 0)}",
        f"[soak] RSS MiB start / peak / end: {samples[0][1]} / {max(s[1] for s in samples)} / {samples[-1][1]}",
        f"[soak] KV usage peak / end of load: {max((s[3] or 0) for s in samples)} / {samples[-1][3]}",
        f"[soak] flatness: {report['flatness']}",
        f"[soak] greedy output unchanged: {report['after']['greedy_server'] == report['greedy_fresh']}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/soak"))
    args = parser.parse_args()
    report = run_soak(args.minutes, args.out, args.clients, args.seed)
    print(json.dumps({k: v for k, v in report.items() if k not in ("failure_notes", "samples")}, indent=1))
    for line in report["failure_notes"]:
        print("[soak] failure:", line)
    print("\n".join(summary(report)))
    print(f"[soak] samples: {args.out / 'samples.csv'}, report: {args.out / 'report.json'}")
    print("[soak] PASSED" if not report["checks_failed"] else f"[soak] FAILED: {report['checks_failed']}")
    return 0 if not report["checks_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
