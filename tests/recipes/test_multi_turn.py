"""Multi-turn rollouts (recipes/calculator_tool.py): the calculator's tokens are context, never
trained on. Oracles: the tool's own output (the masked-out tokens must be exactly it, at the
place it was inserted) and the engine (the policy's tokens keep the engine's logprobs, which the
trainer recomputes bit for bit, so logprob_abs_diff_max over mask-1 tokens is 0)."""

from __future__ import annotations

import math

from recipes.calculator_tool import CALL, tool_result
from recipes.multi_turn import ENV_VERSION
from recipes.recipe import load_recipe, with_overrides


def test_tool_tokens_have_loss_mask_zero(tmp_path):
    from transformers import AutoTokenizer

    from tandem.rl.loop import run
    from tandem.rl.model_source import ModelSource

    recipe = with_overrides(load_recipe("tool_use"), {"steps": 1, "prompts_per_step": 8, "warm_start_steps": 30, "warm_start_batch": 16,
                                                      "engine_backend": "in_process", "wandb": False,
                                                      "save_checkpoint": False})
    result = run(recipe, tmp_path, quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(ModelSource.resolve(recipe.model).path)
    call_id = tokenizer.encode(CALL, add_special_tokens=False)[0]
    samples = [s for g in result.samples for s in g]
    called = [s for s in samples if s.metadata["called_tool"]]
    assert called, "the warm start teaches the call: some sample must have called the calculator"
    for s in samples:
        mask = s.loss_mask
        assert len(mask) == len(s.response_ids) == len(s.rollout_logprobs) == len(s.weight_versions)
        if not s.metadata["called_tool"]:
            assert mask == [1] * len(s.response_ids)
            continue
        first = s.response_ids.index(call_id) + 1  # the model's first turn ends at the call
        result_ids = tokenizer.encode(tool_result(tokenizer.decode(s.prompt_ids)), add_special_tokens=False)
        assert s.response_ids[first:first + len(result_ids)] == result_ids
        assert mask == [1] * first + [0] * len(result_ids) + [1] * (len(mask) - first - len(result_ids))
        assert all(v == ENV_VERSION for v, m in zip(s.weight_versions, mask) if not m)
        assert all(v == "0" for v, m in zip(s.weight_versions, mask) if m)
    step = result.metrics[0]
    assert step["logprob_abs_diff_max"] == 0.0 and math.isfinite(step["loss"])
    assert step["response_len_mean"] == sum(sum(s.loss_mask) for s in samples) / len(samples)
