"""Recipes: loading by name, file and YAML/JSON; command-line overrides typed by the field."""

from __future__ import annotations

import json

import pytest

from recipes.recipe import Recipe, available_recipes, load_recipe, with_overrides


def test_every_shipped_recipe_loads():
    names = available_recipes()
    assert {"default", "tool_use", "qwen3_gpu"} <= set(names)
    for name in names:
        assert isinstance(load_recipe(name), Recipe)


def test_overrides_take_the_field_type():
    r = with_overrides(load_recipe("default"), {"steps": "2", "lr": "1e-3", "off-policy": "true", "tis_cap": "none",
                                                "engine_args": '{"max_running_requests": 8}', "bucket_bytes": "1e6"})
    assert (r.steps, r.lr, r.off_policy, r.tis_cap, r.bucket_bytes) == (2, 1e-3, True, None, 1_000_000)
    assert r.engine_args == {"max_running_requests": 8} and r.model == "tiny"
    with pytest.raises(ValueError, match="unknown recipe field 'stpes'"):
        with_overrides(r, {"stpes": "2"})
    with pytest.raises(ValueError, match="--off-policy: cannot read 'maybe' as bool"):
        with_overrides(r, {"off_policy": "maybe"})
    with pytest.raises(ValueError, match="n_per_prompt must be >= 2"):
        with_overrides(r, {"n_per_prompt": "1"})


def test_recipe_files(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"base": "tool_use", "steps": 3}))
    r = load_recipe(str(path))
    assert r.steps == 3 and r.rollout_fn == "recipes.calculator_tool:calculator_rollout"
    py = tmp_path / "mine.py"
    py.write_text("from recipes.recipe import Recipe\nRECIPE = Recipe(name='mine', steps=4)\n")
    assert load_recipe(str(py)).steps == 4
    with pytest.raises(ValueError, match="no recipe 'nope'"):
        load_recipe("nope")


def test_cli_flags_reach_the_recipe(monkeypatch, tmp_path):
    from tandem.main import build_parser

    args = build_parser().parse_args(["train", "--steps", "2", "--lr=1e-3", "--output-dir", str(tmp_path)])
    assert (args.override_steps, args.override_lr, args.recipe) == ("2", "1e-3", "default")


def test_tandem_train_command_writes_the_run_folder(tmp_path, capsys):
    from tandem.main import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--prompts-per-step", "4", "--engine-backend", "in_process",
                 "--num-engines", "1", "--wandb", "false", "--quiet", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"run folder: {out}" in printed and "checkpoint:" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["logprob_abs_diff_max"] == 0.0
    assert (out / "checkpoint" / "config.json").exists() and (out / "reward_curve.png").exists()
