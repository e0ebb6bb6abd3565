"""`tandem train` on the tiny Qwen3-MoE, two GRPO steps on in-process engines (CI-sized).

In deterministic mode the trainer's logprobs equal the rollout's bit for bit and its routes agree
with the engine's returned ones everywhere (route_agreement 1.0, no replay needed); with
routed_experts="replay" it trains on the rollout's routes (R3) and stays on-policy; the exported
checkpoint (per-expert HF names) loads in HF transformers and greedy-decodes as tandem does.
"""

from __future__ import annotations

import json

import pytest
import torch

from recipes.recipe import load_recipe, with_overrides

SMALL = {"model": "tiny-moe", "steps": 2, "prompts_per_step": 8, "engine_backend": "in_process", "num_engines": 1,
         "wandb": False}


def _run(tmp_path_factory, **overrides):
    from tandem.rl.loop import run

    recipe = with_overrides(load_recipe("default"), {**SMALL, **overrides})
    result = run(recipe, tmp_path_factory.mktemp("run"), quiet=True)
    return result, [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["measure", "replay"])
def test_on_policy_with_full_route_agreement(tmp_path_factory, mode):
    result, rows = _run(tmp_path_factory, routed_experts=mode)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob_abs_diff_max"] == 0.0 and r["route_agreement"] == 1.0 and r["grad_norm"] > 0
    samples = [s for g in result.samples for s in g]
    assert all(s.routed_experts for s in samples)
    if mode == "replay":  # the checkpoint is a Qwen3-MoE HF checkpoint that transformers decodes like tandem
        from transformers import AutoModelForCausalLM

        from engine import Engine

        path = str(result.output_dir / "checkpoint")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        eng = Engine(model_path=path, dtype="float32", device="cpu")
        try:
            prompt = samples[0].prompt_ids
            ours = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True})["output_ids"]
        finally:
            eng.shutdown()
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == theirs


def test_routes_off_reports_no_agreement(tmp_path_factory):
    _, rows = _run(tmp_path_factory, steps=1)
    assert rows[0]["logprob_abs_diff_max"] == 0.0 and "route_agreement" not in rows[0]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="routed_experts must be one of off, measure, replay"):
        with_overrides(load_recipe("default"), {"routed_experts": "always"})
