"""`tandem bench-sync` on the CPU with the tiny model: every transport runs, the phases add up, and
the engine ends up holding the trainer's weights (checked against the trainer's own tensors)."""

from __future__ import annotations

import json

import pytest

from tandem.bench_sync import PHASES, LocalTrainer, measure
from tandem.main import main


def _check(report: dict, num_updates: int) -> None:
    medians = report["median_s"]
    assert set(medians) == {*PHASES, "total"} and all(v >= 0 for v in medians.values())
    assert len(report["updates_total_s"]) == num_updates
    assert medians["load"] > 0 and medians["total"] >= medians["load"]
    assert report["weights_match_trainer"] is True  # random trainer weights != the checkpoint's
    assert report["weight_version"] == f"bench-{num_updates}"


def test_cli_json_report_with_several_buckets(tmp_path, capsys):
    out = tmp_path / "sync.json"
    assert main(["bench-sync", "--preset", "tiny", "--device", "cpu", "--transport", "inprocess",
                 "--num-updates", "5", "--bucket-mb", "0.1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check(report, 5)
    assert report["num_buckets"] >= 5 and report["num_tensors"] == 24  # the tiny Qwen3, tied embeddings
    assert report["total_bytes"] == 558592 and report["memory"] is None  # no GPU here
    assert report["transport"] == "inprocess" and report["device"] == "cpu"
    assert "median (ms): pause" in capsys.readouterr().out


@pytest.mark.parametrize("transport", ["disk", "inprocess"])
def test_measure_each_local_transport(engine_factory, transport):
    eng = engine_factory()
    trainer = LocalTrainer(model_path=eng.info.model_path, dtype="float32", device="cpu", bucket_bytes=1 << 18)
    report = measure(eng, trainer, transport, num_updates=2)
    _check(report, 2)
    total = sum(report["median_s"][p] for p in PHASES)
    assert report["median_s"]["total"] == pytest.approx(total, rel=0.5)
    eng.check_integrity()


def test_cuda_ipc_transport_from_a_spawned_trainer(tmp_path):
    """On the CPU the cuda-ipc path carries named shared memory from the other process."""
    out = tmp_path / "ipc.json"
    assert main(["bench-sync", "--preset", "tiny", "--device", "cpu", "--transport", "cuda-ipc",
                 "--trainer", "process", "--num-updates", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check(report, 2)
    assert report["trainer"] == "process"


def test_gpu_memory_growth_is_counted_from_the_first_update():
    from tandem.bench_sync import memory_report, format_report

    used = lambda gb: {"device_used_gb": gb, "process_reserved_gb": gb / 2}  # noqa: E731
    report = memory_report({"before": used(10.0), "after_first": used(20.0), "after": used(20.1)})
    assert report["device_growth_pct"] == pytest.approx(0.5)
    assert memory_report({"before": None, "after_first": None, "after": None}) is None
    text = format_report({"model": "m", "device": "cuda", "dtype": "bfloat16", "transport": "cuda-ipc",
                          "trainer": "ray", "num_tensors": 3, "total_bytes": 2**30, "num_buckets": 1,
                          "bucket_mb": 1024, "num_updates": 200, "memory": report, "weights_match_trainer": True,
                          "median_s": {p: 0.001 for p in (*PHASES, "total")}})
    assert "20.00 GB after the first update, 20.10 GB after the last (+0.50%)" in text
