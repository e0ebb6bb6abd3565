"""The soak as a pytest test: the long one marked `soak` and skipped unless selected (`-m soak`) or
TANDEM_SOAK_MINUTES is set; the minutes come from that variable (3 by default). Not for CI: it
runs for minutes. `python scripts/soak.py --minutes 30` is the same run as a script. A 20-second
run goes with the suite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite imports with --import-mode=importlib
from soak_run import run_soak  # noqa: E402

@pytest.mark.soak
def test_soak_mixed_load_leaves_no_leak_no_stuck_request_no_5xx(request, tmp_path):
    minutes = os.environ.get("TANDEM_SOAK_MINUTES")
    if minutes is None and "soak" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the soak runs for minutes: select it with -m soak or set TANDEM_SOAK_MINUTES")
    report = run_soak(float(minutes or 3), tmp_path / "soak")
    assert report["requests"] > 0 and report["by_kind"].get("update_weights")
    assert report["checks_failed"] == [], (report["checks_failed"], report["failure_notes"])


def test_a_20_second_soak_passes_every_check(tmp_path):
    """The soak's machinery on a short run (unmarked: it runs with the suite, ~1 minute with the
    server's start-up): load of every kind, usage sampled every 10 s, no failure."""
    report = run_soak(20 / 60, tmp_path / "soak", num_clients=8, seed=1)
    assert report["checks_failed"] == [], (report["checks_failed"], report["failure_notes"])
    assert report["requests"] > 20 and len(report["samples"]) >= 3
    assert all(s[1] > 0 and s[2] is not None for s in report["samples"][1:])
    assert report["flatness"] == {"checked": False, "why": "the run is shorter than 20 minutes"}
    assert (tmp_path / "soak" / "samples.csv").read_text().startswith("seconds,rss_mib,kv_tokens_used")
