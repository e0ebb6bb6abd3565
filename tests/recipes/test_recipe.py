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


def _bomb(levels: int = 9) -> str:
    """A YAML alias bomb: 9 levels of 9 references each stand for 9**9 values."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ntask_args: {{k: *l{levels - 1}}}\n"


@pytest.mark.parametrize("name,text,message", [
    ("deep.yaml", "task_args: " + "[" * 5000 + "]" * 5000, "nests mappings/lists deeper than 32 levels"),
    ("deep.yaml", "task_args:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 40)) + " " * 40 + "v: 1\n",
     "nests mappings/lists deeper than 32 levels"),
    ("deep.json", '{"task_args": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}", "nests too deeply to read"),
    ("wide.json", '{"task_args": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}", "nests mappings/lists deeper than 32"),
    ("bomb.yaml", _bomb(), "holds more than 100,000 values (counting every use of a YAML alias)"),
    ("keys.yaml", "1: 2\n", "field names are strings, got 1"),
    ("huge.json", "{}" + " " * (2 << 20), "is 2,097,154 bytes; a recipe file is at most 1,048,576"),
])
def test_hostile_recipe_files_are_one_line_errors(tmp_path, name, text, message):
    """Issue 27 item 11: deep nesting and alias bombs were tracebacks (or endless work)."""
    import time

    path = tmp_path / name
    path.write_text(text)
    start = time.monotonic()
    with pytest.raises(ValueError) as exc:
        load_recipe(str(path))
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert time.monotonic() - start < 10


def test_a_long_base_chain_is_refused(tmp_path):
    for i in range(300):
        body = f"base: {tmp_path / f'c{i + 1}.yaml'}\n" if i < 299 else "steps: 2\n"
        (tmp_path / f"c{i}.yaml").write_text(body)
    assert load_recipe(str(tmp_path / "c284.yaml")).steps == 2  # 16 files: allowed
    with pytest.raises(ValueError) as exc:
        load_recipe(str(tmp_path / "c0.yaml"))
    assert str(exc.value) == (f"recipe file {tmp_path / 'c0.yaml'}: its base: chain is longer than 16 files "
                              f"(the 17th is {tmp_path / 'c16.yaml'})")
