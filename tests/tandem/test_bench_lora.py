"""`tandem bench --lora-adapters N` on the CPU with the tiny model: the random adapters are PEFT's
format (PEFT itself loads them and agrees on the tokens), every request carries its round-robin
adapter (in process and over HTTP), and the result records the LoRA settings."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from tandem import main as cli
from tandem.bench.workload import build_workload

TINY = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--runs", "1", "--warmup-runs", "0",
        "--stream-mode", "final"]
ENGINE = {"dtype": "float32", "device": "cpu"}


def _bench(tmp_path, *argv: str) -> dict:
    path = tmp_path / "bench.json"
    assert cli.main(["bench", *TINY, "--json", str(path), *argv]) == 0
    return json.loads(path.read_text())


def test_random_adapters_are_peft_format_and_give_peft_tokens(tiny_model_dir, tmp_path):
    """PEFT loads every tensor by its name (none missing, none unexpected) and its greedy tokens are
    tandem's, float32; the non-zero lora_B changes them from the base model's."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft (the test extra)")
    from engine import Engine
    from engine.testing.random_lora import write_random_adapters
    from tests.engine.lora_setup import PROMPTS, engine_greedy, peft_greedy

    (adapter,) = write_random_adapters(tiny_model_dir, str(tmp_path), 1, rank=4, target_modules=["all-linear"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7
    oracle, _ = peft_greedy(tiny_model_dir, adapter, PROMPTS)
    base, _ = peft_greedy(tiny_model_dir, None, PROMPTS)
    assert oracle != base
    eng = Engine(model_path=tiny_model_dir, **ENGINE, lora_paths=[f"a={adapter}"])
    try:
        assert engine_greedy(eng, PROMPTS, lora_path="a")[0] == oracle
    finally:
        eng.shutdown()


def test_targets_and_dense_linears_only(tiny_model_dir, tmp_path):
    from engine.testing.random_lora import lora_shapes, random_lora_tensors

    shapes = lora_shapes(tiny_model_dir, ["q_proj", "down_proj"])
    assert {m.rpartition(".")[2] for m, _, _ in shapes} == {"q_proj", "down_proj"} and len(shapes) == 4  # 2 layers
    named = dict(random_lora_tensors(shapes, rank=3, seed=0))
    module, rows, cols = shapes[0]
    a, b = named[f"base_model.model.{module}.lora_A.weight"], named[f"base_model.model.{module}.lora_B.weight"]
    assert a.shape == (3, cols) and b.shape == (rows, 3) and b.abs().sum() > 0
    with pytest.raises(ValueError, match="not supported"):
        lora_shapes(tiny_model_dir, ["lm_head"])


def test_moe_experts_get_no_adapter(tmp_path):
    """The engine serves LoRA on dense linears: a MoE model's adapters cover its attention only."""
    from engine.testing.random_lora import lora_shapes
    from engine.testing.tiny_model import tiny_model_path

    shapes = lora_shapes(str(tiny_model_path(preset="tiny-moe")))
    assert {m.rpartition(".")[2] for m, _, _ in shapes} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_bench_json_records_lora_settings(tmp_path, capsys):
    result = _bench(tmp_path, "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
                    "--lora-adapters", "2", "--lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj")
    assert result["lora"] == {"adapters": 2, "rank": 4, "target_modules": ["q_proj", "v_proj"],
                              "max_loras_per_batch": 8, "assignment": "round-robin"}
    args = result["server_args"]
    assert args["enable_lora"] and args["max_lora_rank"] == 4 and len(args["lora_paths"]) == 2
    assert result["workload"]["lora_adapters"] == 2
    assert result["tandem"]["median"]["output_tokens"] == 5 * 4
    assert "LoRA: 2 adapter(s) of rank 4 on q_proj, v_proj" in capsys.readouterr().out


def test_base_run_records_no_adapters_and_more_adapters_raise_the_batch_limit(tmp_path):
    assert _bench(tmp_path, "--num-prompts", "2", "--input-len", "8", "--output-len", "2")["lora"] == {"adapters": 0}
    result = _bench(tmp_path, "--num-prompts", "10", "--input-len", "8", "--output-len", "2",
                    "--lora-adapters", "9", "--lora-rank", "2")
    assert result["lora"]["max_loras_per_batch"] == 10 == result["server_args"]["max_loras_per_batch"]


def test_requests_carry_their_round_robin_adapter(tiny_model_dir):
    """Each request's tokens are those of its adapter run alone (deterministic: batch-invariant);
    each adapter changes the base model's tokens."""
    from engine import Engine
    from tandem.bench.lora_mode import prepare_lora
    from tandem.bench.tandem_run import measure

    args = argparse.Namespace(lora_adapters=2, lora_rank=4, lora_target_modules=(), seed=0)
    kwargs = dict(model_path=tiny_model_dir, **ENGINE, enable_deterministic_inference=True)
    lora = prepare_lora(args, kwargs)
    workload = build_workload("random", 4, 8, 6, 1000)
    eng = Engine(**kwargs)
    try:
        def ids(paths):
            return measure(eng, workload.with_adapters(paths), torch.device("cpu"), "final").output_ids

        mixed, base = ids(lora.request_adapters(4)), ids(None)
        assert lora.request_adapters(4) == ["adapter-0", "adapter-1", "adapter-0", "adapter-1"]
        for i, name in enumerate(lora.request_adapters(4)):
            assert mixed[i] == ids([name] * 4)[i]
        assert mixed[0] != base[0] and mixed[1] != base[1]  # each adapter changes some tokens
    finally:
        eng.shutdown()
        lora.cleanup()


def test_served_bench_sends_each_requests_adapter(tmp_path):
    """Over HTTP too: the served engine's tokens equal the in-process ones (lora_path in the body)."""
    result = _bench(tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                    "--enable-deterministic-inference", "--lora-adapters", "2", "--lora-rank", "4", "--serve")
    assert result["ratios"]["http_agreement"] == 1.0 and "--lora-paths" in result["serve_command"]


@pytest.mark.parametrize("argv, message", [
    (["--lora-adapters", "1", "--compare-hf"], "drop --compare-hf"),
    (["--lora-adapters", "1", "--lora-rank", "32", "--max-lora-rank", "16"], "exceeds --max-lora-rank"),
    (["--lora-adapters", "-1"], "must be >= 0"),
    (["--lora-adapters", "1", "--lora-rank", "0"], "--lora-rank >= 1"),
])
def test_bad_lora_flags_are_named(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        _bench(tmp_path, *argv)
