"""`tandem train` on a GPU: the DeepSpeed trainer colocated with a Ray engine actor (CUDA IPC push).

Oracle: the engine's rollout logprobs; in deterministic mode the DeepSpeed-wrapped Policy's
recomputation must equal them bit for bit at every step, for ZeRO-2 and ZeRO-3 (which gathers
each push bucket). Run: python -m pytest -q tests/gpu/test_train_gpu.py
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_colocated_deepspeed_grpo_is_on_policy(tmp_path, zero_stage):
    pytest.importorskip("deepspeed")
    pytest.importorskip("ray")
    from tandem.rl.loop import run
    from recipes.recipe import load_recipe, with_overrides

    recipe = with_overrides(load_recipe("qwen3_gpu"), {
        "model": "tiny", "steps": 3, "prompts_per_step": 8, "max_new_tokens": 32, "zero_stage": zero_stage,
        "bucket_bytes": 64 << 10, "lr": 1e-4, "wandb": False,
        "engine_args": {"mem_fraction_static": 0.2, "enable_memory_saver": True}})
    result = run(recipe, tmp_path / f"zero{zero_stage}", quiet=True)
    rows = result.metrics
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert [r["rollout_weight_versions"] for r in rows] == [["0"], ["1"], ["2"]]
    for r in rows:
        assert r["logprob_abs_diff_max"] == 0.0, r
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert (result.checkpoint / "model.safetensors").exists()
