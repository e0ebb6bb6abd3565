"""LoRA RL (`tandem train --recipe lora`): the base frozen, a PEFT adapter trained and pushed alone.

Oracles: the engine's rollout logprobs (the trainer's recomputation through the same LoRA delta
code must equal them bit for bit in deterministic mode, every step), the tiny model's own size
(a push moves the adapter, a small fraction of it), and HF transformers + PEFT on the saved
adapter (greedy tokens equal tandem's serving it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from recipes.recipe import load_recipe, with_overrides

FAST = {"engine_backend": "in_process", "wandb": False}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The shipped lora recipe, whole (30 steps), on in-process engines: ~30 s on 2 cores."""
    from tandem.rl.loop import run

    recipe = with_overrides(load_recipe("lora"), FAST)
    result = run(recipe, tmp_path_factory.mktemp("lora_run"), quiet=True)
    return recipe, result


def test_lora_rl_learns_with_logprob_diff_zero_every_step(lora_run):
    recipe, result = lora_run
    metrics = (result.output_dir / "metrics.jsonl").read_text()
    rows = list(map(json.loads, metrics.splitlines()))
    assert len(rows) == recipe.steps == 30
    assert [r["logprob_abs_diff_max"] for r in rows] == [0.0] * len(rows)  # trainer == engine, bit for bit
    # step k's samples came from the adapter pushed after step k-1 (0: the warm-started adapter)
    assert [r["rollout_weight_versions"] for r in rows] == [[str(k)] for k in range(len(rows))]
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, f"reward {first:.3f} (first 3 steps) -> {last:.3f} (last 5): {rewards}"


def test_pushes_carry_only_the_adapter(lora_run):
    from safetensors.torch import load_file

    from tandem.rl.model_source import ModelSource

    recipe, result = lora_run
    adapter = load_file(str(result.checkpoint / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_dir = Path(ModelSource.resolve(recipe.model, recipe.seed).path)
    model = {n: t for f in model_dir.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    assert all(".lora_A." in n or ".lora_B." in n for n in adapter) and len(adapter) == 2 * 7 * 2  # 2 layers
    assert {r["push_bytes"] for r in result.metrics} == {adapter_bytes}
    assert adapter_bytes * 5 < model_bytes, (adapter_bytes, model_bytes)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (the test extra)")
def test_saved_adapter_is_peft_and_serves_its_greedy_tokens(lora_run):
    from engine import Engine
    from tandem.rl.model_source import ModelSource
    from tests.engine.lora_setup import PROMPTS, engine_greedy, peft_greedy

    recipe, result = lora_run
    base = str(ModelSource.resolve(recipe.model, recipe.seed).path)
    config = json.loads((result.checkpoint / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    peft_ids, _ = peft_greedy(base, result.checkpoint, PROMPTS)
    base_ids, _ = peft_greedy(base, None, PROMPTS)
    assert peft_ids != base_ids  # the trained adapter changes what the model says
    with Engine(model_path=base, dtype="float32", device="cpu", log_level="warning",
                lora_paths=(f"policy={result.checkpoint}",)) as engine:
        tandem_ids, _ = engine_greedy(engine, PROMPTS, lora_path="policy")
    assert tandem_ids == peft_ids


def test_lora_trainer_freezes_the_base_and_steps_only_the_adapter():
    from tandem.rl.model_source import ModelSource
    from tandem.rl.trainer_setup import build_trainer

    recipe = with_overrides(load_recipe("lora"), {**FAST, "lora_rank": 4, "lora_target_modules": "q_proj,v_proj"})
    trainer = build_trainer(recipe, ModelSource.resolve(recipe.model, recipe.seed))
    lora = trainer.policy.lora
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in lora.weights} and len(held) == 2 * 2 * 2  # 2 layers x q, v x A, B
    assert not any(p.requires_grad for p in trainer.policy.model.parameters())
    base = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
    before = [p.detach().clone() for p in lora.weights]
    trainer.supervised_step([[5, 6, 7]], [[8, 9]], lr=1e-2)
    assert all(torch.equal(p, base[n]) for n, p in trainer.policy.model.named_parameters())
    changed = [not torch.equal(a, b) for a, b in zip(before, lora.weights)]
    # PEFT's init: B = 0, so the first step moves B only (A's gradient is B^T times something)
    assert changed == [name.endswith("lora_B.weight") for name in lora.names]


@pytest.mark.parametrize("overrides, message", [
    ({"lora_rank": "-1"}, "lora_rank must be in"),
    ({"lora_rank": "8", "lora_alpha": "0"}, "lora_alpha must be a finite number > 0"),
    ({"lora_rank": "8", "lora_target_modules": "q_proj,lm_head"}, "'lm_head' is not supported"),
    ({"lora_rank": "8", "lora_target_modules": " , "}, "names no module"),
    ({"lora_rank": "8", "trainer": "deepspeed"}, "torch trainer only"),
])
def test_bad_lora_fields_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        with_overrides(load_recipe("default"), overrides)


def test_lora_fields_are_train_flags():
    from tandem.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lora-rank", "16", "--lora-alpha", "32", "--lora-target-modules", "q_proj,v_proj"])
    overrides = {k.removeprefix("override_"): v for k, v in vars(args).items() if k.startswith("override_") and v}
    recipe = with_overrides(load_recipe("default"), overrides)
    assert (recipe.lora_rank, recipe.lora_alpha, recipe.lora_targets) == (16, 32.0, ("q_proj", "v_proj"))
