"""`tandem bench-sync --transport nccl` on the CPU: a spawned trainer process, rank 0 of a gloo
weight group, broadcasts its random weights one flattened bucket at a time; the phases add up and
the engine ends up holding the trainer's weights (checked against the trainer's own tensors)."""

from __future__ import annotations

import json

import pytest

from tandem.bench_sync import PHASES
from tandem.main import main


def test_nccl_transport_from_a_trainer_process_over_gloo(tmp_path, capsys):
    out = tmp_path / "nccl.json"
    assert main(["bench-sync", "--preset", "tiny", "--device", "cpu", "--transport", "nccl",
                 "--num-updates", "2", "--bucket-mb", "0.1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    medians = report["median_s"]
    assert set(medians) == {*PHASES, "total"} and all(v >= 0 for v in medians.values())
    assert medians["transfer"] > 0 and medians["total"] == pytest.approx(sum(medians[p] for p in PHASES), rel=0.5)
    assert len(report["updates_total_s"]) == 2 and report["weight_version"] == "bench-2"
    assert report["weights_match_trainer"] is True  # random trainer weights != the checkpoint's
    assert report["num_buckets"] >= 5 and report["num_tensors"] == 24 and report["total_bytes"] == 558592
    assert (report["transport"], report["trainer"], report["device"]) == ("nccl", "process", "cpu")
    assert "transport nccl (trainer: process)" in capsys.readouterr().out
