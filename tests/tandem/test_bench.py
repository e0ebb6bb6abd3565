"""`tandem bench` on the CPU with the tiny model: the numbers it reports are the right ones."""

from __future__ import annotations

import json

import pytest
import torch

from tandem import main as cli
from tandem.bench.hf_weights import hf_named_tensors
from tandem.bench.roofline import DeviceRates, ModelShape, floor
from tandem.bench.stats import median_of_runs, percentile
from tandem.bench.tandem_run import TokenTrace
from tandem.bench.workload import build_workload

TINY = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--runs", "1"]


def _bench(tmp_path, *argv: str) -> dict:
    path = tmp_path / "bench.json"
    assert cli.main(["bench", *TINY, "--json", str(path), *argv]) == 0
    return json.loads(path.read_text())


def test_random_workload_with_hf_and_roofline(tmp_path, capsys):
    result = _bench(tmp_path, "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                    "--compare-hf", "--roofline")
    med = result["tandem"]["median"]
    assert med["output_tokens"] == med["expected_output_tokens"] == 4 * 8  # ignore_eos, exact
    assert med["input_tokens"] == 4 * 16 and med["not_length_finished"] == 0
    assert 0.0 <= med["cache_hit_rate"] <= 1.0 and med["retractions"] == 0
    assert med["output_tok_s"] > 0 and med["input_tok_s"] > 0 and med["peak_memory_gb"] > 0
    assert 0 < med["ttft_median_ms"] <= med["ttft_p99_ms"]
    assert 0 < med["itl_median_ms"] <= med["itl_p99_ms"]
    assert result["hf"]["median"]["output_tok_s"] > 0
    assert result["ratios"]["hf_agreement"] == 1.0  # float32: the same greedy tokens as HF
    assert result["ratios"]["tandem_over_hf"] > 0
    roof = result["roofline"]
    assert roof["output_tok_s"] > 0 and roof["decode_steps"] == 8
    assert 0 < result["ratios"]["tandem_over_roofline"]
    assert result["device"] and result["torch_version"] == torch.__version__ and result["command"]
    assert result["args"]["num_prompts"] == 4 and result["args"]["compare_hf"] is True
    out = capsys.readouterr().out
    assert "output tok/s" in out and "roofline output tok/s" in out and "tandem / HF" in out


def test_hf_on_the_first_requests_of_a_moe_model(tmp_path):
    """--hf-num-prompts: HF generates only the first N requests (a 30B MoE's HF copy and full batch
    do not fit beside the engine's); agreement is over those, and the MoE weights line up with HF's."""
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--preset", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--num-prompts", "4",
                     "--input-len", "16", "--output-len", "6", "--runs", "1", "--compare-hf",
                     "--hf-num-prompts", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["hf"]["num_requests"] == 2 and result["hf"]["median"]["output_tokens"] == 2 * 6
    assert result["ratios"]["hf_agreement"] == 1.0
    assert result["tandem"]["median"]["routed_experts_returned"] == 0


def test_an_engine_returning_routed_experts_returns_them_for_every_request(tmp_path):
    path = tmp_path / "bench.json"
    assert cli.main(["bench", "--preset", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--num-prompts", "3",
                     "--input-len", "8", "--output-len", "4", "--runs", "1", "--enable-return-routed-experts",
                     "--json", str(path)]) == 0
    assert json.loads(path.read_text())["tandem"]["median"]["routed_experts_returned"] == 3


def test_grpo_workload_shares_prompts(tmp_path):
    result = _bench(tmp_path, "--workload", "grpo", "--num-prompts", "2", "--n", "4",
                    "--input-len", "64", "--output-len", "4", "--stream-mode", "final",
                    "--temperature", "1.0")  # sampled, as GRPO rollouts are
    assert result["workload"]["temperature"] == 1.0
    med = result["tandem"]["median"]
    assert med["output_tokens"] == 2 * 4 * 4 and med["input_tokens"] == 2 * 4 * 64
    assert med["cache_hit_rate"] > 0.5  # 3 of every 4 samples read the prompt from the tree
    assert med["ttft_median_ms"] is None  # final mode sends no per-token messages
    assert result["workload"]["num_prompts"] == 2 and result["workload"]["num_requests"] == 8


def test_mixed_lengths_and_seeds():
    w = build_workload("random", 50, 40, 20, vocab_size=100, range_ratio=0.5, seed=3)
    assert all(20 <= n <= 40 for n in w.input_lens) and len(set(w.input_lens)) > 1
    assert all(10 <= n <= 20 for n in w.output_lens)
    assert all(0 <= t < 100 for ids in w.input_ids for t in ids)
    assert w.input_ids == build_workload("random", 50, 40, 20, 100, 0.5, seed=3).input_ids
    assert w.input_ids != build_workload("random", 50, 40, 20, 100, 0.5, seed=4).input_ids


def test_grpo_repeats_each_prompt_adjacently():
    w = build_workload("grpo", 3, 10, 5, vocab_size=1000, n=4)
    assert w.num_requests == 12 and w.num_prompts == 3
    assert all(w.input_ids[i] == w.input_ids[i - i % 4] for i in range(12))
    assert w.unique_input_lens == [10, 10, 10]
    with pytest.raises(ValueError, match="grpo"):
        build_workload("random", 3, 10, 5, vocab_size=1000, n=2)


def test_temperature_reaches_the_requests_and_bad_values_are_named(tmp_path):
    w = build_workload("grpo", 2, 10, 5, vocab_size=1000, n=3, temperature=0.7)
    assert {p["temperature"] for p in w.sampling_params()} == {0.7}
    assert {p["temperature"] for p in build_workload("random", 2, 10, 5, 1000).sampling_params()} == {0.0}
    with pytest.raises(ValueError, match="temperature"):
        build_workload("random", 2, 10, 5, vocab_size=1000, temperature=-1.0)
    with pytest.raises(SystemExit, match="--compare-hf runs greedy"):
        _bench(tmp_path, "--num-prompts", "2", "--compare-hf", "--temperature", "1.0")


def test_hf_names_round_trip_through_load_weights(engine):
    model = engine.local_core.runner.model
    names = dict(hf_named_tensors(model))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    loaded = model.load_weights(names.items())  # writes the same values back
    assert model.missing_weights(loaded) == []


def test_token_trace_and_percentiles():
    trace = TokenTrace()
    for t, n in [(1.0, 1), (1.5, 2), (1.5, 2), (2.5, 4)]:
        trace.add(t, n)
    assert trace.first == 1.0 and trace.gaps == [0.5, 0.5, 0.5]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 99) is None
    assert median_of_runs([{"a": 1, "b": None}, {"a": 3, "b": None}, {"a": 2, "b": None}]) == {"a": 2, "b": None}


def test_roofline_floor_arithmetic():
    rates = DeviceRates(copy_bandwidth_bytes_s=1e12, matmul_flops_s=1e15, matmul_dtype="bf16", matmul_size=8192)
    shape = ModelShape(decode_weight_bytes=10**9, matmul_params=5 * 10**8, lm_head_params=10**8,
                       kv_bytes_per_token=10**5, num_layers=2, num_heads=4, head_dim=8)
    w = build_workload("random", 10, 100, 50, vocab_size=50)
    roof = floor(w, shape, rates, max_batch=10)
    step_bytes = 10**9 + 10 * (100 + 25) * 10**5
    assert roof["decode_step_bytes"] == step_bytes and roof["decode_steps"] == 50
    assert roof["decode_bound"] == "memory"
    assert roof["decode_floor_s"] == pytest.approx(50 * step_bytes / 1e12)
    assert roof["output_tok_s"] == pytest.approx(500 / (roof["prefill_floor_s"] + roof["decode_floor_s"]))
    assert floor(w, shape, rates, max_batch=10, shared_prefix=True) == {**roof, "shared_prefix_reads": False}
    # grpo, 2 prompts x 5 samples: with cascade decode a prompt's KV is read once per group
    g = build_workload("grpo", 2, 100, 50, vocab_size=50, n=5)
    plain, shared = (floor(g, shape, rates, max_batch=10, shared_prefix=on) for on in (False, True))
    assert plain["decode_step_bytes"] == step_bytes and not plain["shared_prefix_reads"]
    assert shared["decode_step_bytes"] == 10**9 + (2 * 100 + 10 * 25) * 10**5 and shared["shared_prefix_reads"]


def test_profile_report_on_cpu_and_format():
    import torch

    from tandem.bench.profile import format_profile, profile_run

    skipped = profile_run(None, None, torch.device("cpu"), "final", 5)
    assert "CUDA" in skipped["skipped"] and format_profile(skipped).startswith("profile skipped")
    report = {"wall_s": 2.0, "busy_s": 1.5, "busy_share": 0.75, "output_tok_s": 1000.0,
              "top": [{"name": "split_kv_stage1", "calls": 10, "total_ms": 900.0, "mean_us": 90000.0,
                       "share": 0.6}]}
    lines = format_profile(report).splitlines()
    assert "kernel time 1.500 s (75% of wall)" in lines[0]
    assert lines[2].split()[:3] == ["60.0%", "900.00", "10"] and lines[2].endswith("split_kv_stage1")


# ---- over HTTP: --url (a running server) and --serve (bench starts one) ---------------------------
@pytest.fixture(scope="module")
def live_server(engine_factory):
    """A real uvicorn server on a free port, over a deterministic engine: batch-invariant, so HTTP
    and in-process greedy outputs are bitwise comparable."""
    pytest.importorskip("httpx")
    import socket
    import threading

    import uvicorn

    from engine.server.http import create_app

    eng = engine_factory(enable_deterministic_inference=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(eng), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    yield eng, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_url_bench_streams_and_equals_in_process(tmp_path, live_server):
    from tandem.bench.http_run import HttpBench

    eng, url = live_server
    path = tmp_path / "http.json"
    assert cli.main(["bench", "--url", url, "--num-runs", "2", "--warmup-runs", "1", "--num-prompts", "3",
                     "--input-len", "8", "--output-len", "5", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    med = result["http"]["median"]
    assert len(result["http"]["runs"]) == 2 and "tandem" not in result
    assert med["output_tokens"] == med["expected_output_tokens"] == 3 * 5 and med["input_tokens"] == 3 * 8
    assert med["not_length_finished"] == 0 and med["cache_hit_rate"] == 0.0  # flushed before each run
    assert 0 < med["ttft_median_ms"] <= med["ttft_p99_ms"] and 0 < med["itl_median_ms"]
    assert result["workload"]["num_requests"] == 3 and result["dtype"] == "float32"

    workload = build_workload("random", 4, 10, 6, vocab_size=eng.info.vocab_size, seed=5)
    outcome = HttpBench(url).run_all(workload, workload, 0, 1, "final")[0]
    direct = eng.generate(input_ids=workload.input_ids, sampling_params=workload.sampling_params())
    assert outcome.output_ids == [o["output_ids"] for o in direct]
    assert outcome.metrics["output_tokens"] == 4 * 6 and outcome.metrics["ttft_median_ms"] is None
    # the way to the core and back: more than nothing, less than the run (each request's e2e is in it)
    assert 0 < outcome.metrics["outside_core_median_ms"] <= outcome.metrics["outside_core_max_ms"]
    assert med["outside_core_median_ms"] > 0  # streamed runs too (timed at their last chunk)


def test_serve_bench_reports_http_beside_in_process(tmp_path, capsys):
    result = _bench(tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--warmup-runs", "0",
                    "--stream-mode", "final", "--enable-deterministic-inference", "--serve")
    assert result["http"]["median"]["output_tokens"] == result["tandem"]["median"]["output_tokens"] == 3 * 4
    assert result["ratios"]["http_agreement"] == 1.0  # greedy, batch-invariant: the same ids over HTTP
    assert result["ratios"]["http_over_in_process"] > 0
    assert "--enable-deterministic-inference" in result["serve_command"]
    out = capsys.readouterr().out
    assert "tandem HTTP" in out and "tandem HTTP / in-process output tok/s" in out
    assert "outside core max ms" in out and result["tandem"]["median"].get("outside_core_max_ms") is None


def test_outside_core_is_each_latency_less_the_cores_own():
    from tandem.bench.http_run import outside_core_ms

    finals = [{"meta_info": {"e2e_latency": e}} for e in (0.5, 0.4, 0.45)]
    got = outside_core_ms([0.51, 0.43, 0.46], finals)
    assert got["outside_core_median_ms"] == pytest.approx(10.0) and got["outside_core_max_ms"] == pytest.approx(30.0)
    assert outside_core_ms([0.1], [{"meta_info": {}}]) == {"outside_core_median_ms": None, "outside_core_max_ms": None}


def test_http_flags_that_cannot_go_together(tmp_path):
    with pytest.raises(SystemExit, match="not both"):
        _bench(tmp_path, "--url", "http://127.0.0.1:1", "--serve")
    with pytest.raises(SystemExit, match="--roofline"):
        _bench(tmp_path, "--url", "http://127.0.0.1:1", "--roofline")
    with pytest.raises(SystemExit, match="--compare-hf"):
        _bench(tmp_path, "--core-process", "--compare-hf")


def test_server_args_round_trip_through_flags():
    from tandem.main import build_parser
    from tandem.server_args import server_args_from_namespace, server_args_to_argv
    from engine.config import ServerArgs

    kwargs = {"model_path": "/m", "core_process": True, "dtype": "float32", "max_running_requests": 8,
              "disable_radix_cache": True, "chunked_prefill_size": -1}
    ns = build_parser().parse_args(["serve", *server_args_to_argv(kwargs)])
    assert ServerArgs(**server_args_from_namespace(ns)) == ServerArgs(**kwargs)
