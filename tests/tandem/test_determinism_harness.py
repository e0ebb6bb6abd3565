"""`tandem determinism` and `tandem replay` on the tiny model, CPU, deterministic mode.

The harness (in-process and over HTTP) must report 1 unique output and a logprob difference of
exactly 0 in every mode; a recorded run must replay bit for bit; a tampered logprob, a missing
field, another model or weight version and malformed JSON must be named, the rest replayed.
"""

from __future__ import annotations

import json

import pytest

from tandem.determinism.client import EngineClient, HttpClient
from tandem.determinism.harness import MODES, Harness, HarnessConfig, waves
from tandem.determinism.replay import Replayer
from tandem.main import main

SMALL = dict(trials=4, max_new_tokens=6, prompt_len=100, prefix_lens=(1, 63, 65, 130))


@pytest.fixture(scope="module")
def det_engine(engine_factory):
    # chunks of 64 = the CPU split size: prefix lengths 63 / 65 / 130 cross chunk and split cuts
    return engine_factory(enable_deterministic_inference=True, chunked_prefill_size=64)


@pytest.fixture(scope="module")
def recorded(engine_factory, tmp_path_factory) -> list[dict]:
    """A mix of requests run on a recording engine (default chunking); the file's records."""
    path = tmp_path_factory.mktemp("rec") / "rec.jsonl"
    eng = engine_factory(enable_deterministic_inference=True, record_path=str(path))
    prompts = [[11, 12, 13, 14, 15] * 20, [40 + i for i in range(70)], [7, 8, 9]]
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 123, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params=[greedy, sampled, greedy], return_logprob=True)
    eng.generate(input_ids=prompts[1], sampling_params={**sampled, "n": 2}, return_logprob=True,
                 logprob_start_len=3)
    eng.generate(input_ids=prompts[2], sampling_params={**sampled, "sampling_seed": None})  # no logprobs
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


# ---- harness ----------------------------------------------------------------------------------
def test_waves_sum_to_trials():
    assert waves(1) == [1] and waves(5) == [1, 2, 2] and sum(waves(50)) == 50


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_harness_in_process_every_mode_is_bitwise(det_engine, temperature):
    results = Harness(EngineClient(det_engine), HarnessConfig(**SMALL, temperature=temperature)).run(list(MODES))
    for r in results:
        assert r.max_unique == 1 and r.max_delta == 0.0 and r.passed, r
    prefix = next(r for r in results if r.mode == "prefix")
    assert set(prefix.unique) == {"len 1", "len 63", "len 65", "len 130"}
    radix = next(r for r in results if r.mode == "radix")
    assert "4 warm runs (4 with cache hits)" in radix.notes[0]


def test_harness_over_http(det_engine):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(det_engine)) as http:
        client = HttpClient(http=http)
        assert client.model_info()["vocab_size"] == det_engine.local_core.parts.vocab_size  # from config.json
        results = Harness(client, HarnessConfig(**SMALL)).run(["radix", "p_vs_d"])
    assert all(r.passed and r.max_unique == 1 and r.max_delta == 0.0 for r in results), results


def test_determinism_cli_writes_json_and_exit_code(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "det.json"
    argv = ["determinism", "--model-path", tiny_model_dir, "--device", "cpu", "--dtype", "float32",
            "--mode", "p_vs_d", "--trials", "2", "--max-new-tokens", "4", "--prompt-len", "40",
            "--json", str(out)]
    assert main(argv) == 0
    assert "p_vs_d" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["passed"] and data["modes"][0]["max_delta"] == 0.0 and data["server"]["deterministic"]


# ---- record / replay --------------------------------------------------------------------------
def test_recorded_fields(recorded, tiny_model_dir):
    assert len(recorded) == 6  # a batch of 3, a group of n=2, 1 more; in finishing order
    rec = recorded[0]
    assert rec["model_path"] == tiny_model_dir and rec["weight_version"] == "default"
    assert len(rec["output_ids"]) == len(rec["output_token_logprobs"]) == 8
    group = [r for r in recorded if r["logprob_start_len"] == 3]
    assert len(group) == 2 and group[0]["sampling_seed"] != group[1]["sampling_seed"]
    assert recorded[-1]["output_token_logprobs"] is None and isinstance(recorded[-1]["sampling_seed"], int)


def test_replay_round_trip_is_bitwise(det_engine, recorded, tmp_path):
    path = write_lines(tmp_path / "rec.jsonl", recorded)
    with open(path) as f:
        summary = Replayer(EngineClient(det_engine), batch_size=3).run(f)
    assert summary.ok and summary.replayed == summary.matched == len(recorded), summary


def test_replay_reports_a_tampered_logprob(det_engine, recorded, tmp_path):
    tampered = json.loads(json.dumps(recorded))
    tampered[1]["output_token_logprobs"][3] += 1e-7
    with open(write_lines(tmp_path / "t.jsonl", tampered)) as f:
        summary = Replayer(EngineClient(det_engine)).run(f)
    assert summary.mismatched == 1 and summary.matched == len(recorded) - 1
    (m,) = summary.mismatches
    assert (m.index, m.line, m.kind, m.position) == (1, 2, "logprob", 3)
    assert m.expected == tampered[1]["output_token_logprobs"][3]
    assert m.got == recorded[1]["output_token_logprobs"][3]


def test_replay_names_bad_records_and_replays_the_rest(recorded, tiny_model_dir, tmp_path, capsys):
    missing = {k: v for k, v in recorded[1].items() if k != "sampling_seed"}
    other_model = {**recorded[2], "model_path": "/models/other"}
    other_version = {**recorded[3], "weight_version": "step-7"}
    lines = [recorded[0], "{not json", missing, other_model, other_version, recorded[4]]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    report = tmp_path / "replay.json"
    argv = ["replay", path, "--model-path", tiny_model_dir, "--device", "cpu", "--dtype", "float32",
            "--json", str(report)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "line 2: malformed JSON" in out
    assert f"line 3 (rid {recorded[1]['rid']}): field 'sampling_seed': missing" in out
    assert f"line 4 (rid {recorded[2]['rid']}): field 'model_path'" in out
    assert f"line 5 (rid {recorded[3]['rid']}): field 'weight_version'" in out
    data = json.loads(report.read_text())
    assert (data["replayed"], data["matched"], data["mismatched"]) == (2, 2, 0)
    assert [p["line"] for p in data["problems"]] == [2, 3, 4, 5]


def test_records_after_a_disk_update_replay_on_that_checkpoint(engine_factory, other_model_dir, tmp_path, capsys):
    """The records name the checkpoint and version they ran on; the replay starts an engine there
    (--weight-version: the version the update named)."""
    path = tmp_path / "after.jsonl"
    eng = engine_factory(enable_deterministic_inference=True, record_path=str(path))
    ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="step-7")
    assert ok, message
    eng.generate(input_ids=[[7, 8, 9], [40, 41]], sampling_params={"max_new_tokens": 6, "temperature": 0.0},
                 return_logprob=True)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["model_path"], r["weight_version"]) for r in records} == {(other_model_dir, "step-7")}
    argv = ["replay", str(path), "--model-path", other_model_dir, "--weight-version", "step-7", "--device", "cpu",
            "--dtype", "float32", "--enable-deterministic-inference"]
    assert main(argv) == 0, capsys.readouterr().out
