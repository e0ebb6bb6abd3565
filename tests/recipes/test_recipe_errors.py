"""A recipe a user wrote wrong: each mistake is one ValueError naming the file (and line) and the
field, never a SyntaxError / TypeError traceback from inside the loader or the loop."""

from __future__ import annotations

import pytest

from recipes.recipe import Recipe, load_recipe, with_overrides

HEAD = "from recipes.recipe import Recipe\n"


@pytest.mark.parametrize("body,message", [
    (HEAD + "RECIPE = Recipe(name='mine', steps=1\n", "line 2: SyntaxError: '(' was never closed"),
    (HEAD + "RECIPE = Recipe(name='mine', stepz=1)\n",
     "line 2: TypeError: Recipe.__init__() got an unexpected keyword argument 'stepz'"),
    ("import no_such_package_here\n", "line 1: ModuleNotFoundError: No module named 'no_such_package_here'"),
    (HEAD + "\nRECIPE = Recipe(steps=0)\n", "line 3: steps must be >= 1, got 0"),
    (HEAD + "RECIPE = Recipe(steps=1.5)\n", "line 2: steps must be an integer, got 1.5 (float)"),
])
def test_a_broken_py_recipe_names_its_file_and_line(tmp_path, body, message):
    path = tmp_path / "mine.py"
    path.write_text(body)
    with pytest.raises(ValueError) as exc:
        load_recipe(str(path))
    assert str(exc.value) == f"recipe file {path}: {message}"


@pytest.mark.parametrize("name,text,message", [
    ("a.yaml", "steps: [1\n", " is not valid YAML: expected ',' or ']', but got '<stream end>' (line 2, column 1)"),
    ("a.json", '{"steps": 1,', " is not valid JSON: Expecting property name enclosed in double quotes (line 1, "
                               "column 13)"),
    ("a.json", "", " is not valid JSON: Expecting value (line 1, column 1)"),
    ("a.yaml", "stepz: 1\n", ": unknown recipe field 'stepz'; did you mean 'steps'?"),
    ("a.yaml", "steps: abc\n", ": steps: cannot read 'abc' as int"),
    ("a.yaml", "steps: 1.5\n", ": steps must be an integer, got 1.5 (float)"),
    ("a.yaml", "steps: true\n", ": steps must be an integer, got True (bool)"),
    ("a.json", '{"steps": null}', ": steps must be an integer, got None (NoneType)"),
    ("a.yaml", "lr: [1]\n", ": lr must be a number, got [1] (list)"),
    ("a.yaml", "deterministic: 3\n", ": deterministic must be true or false, got 3 (int)"),
    ("a.yaml", "task_args: 3\n", ": task_args must be a mapping (a JSON object on the command line), got 3 (int)"),
    ("a.yaml", "base: nope\n", ": no recipe 'nope'"),
    ("a.json", "[1, 2]", ": a recipe file is a mapping of field: value"),
])
def test_a_broken_yaml_or_json_recipe_names_its_file(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        load_recipe(str(path))
    assert str(exc.value).startswith(f"recipe file {path}{message}"), str(exc.value)


def test_file_values_take_the_field_type(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("base: default\nsteps: 3\ntemperature: 1\nlr: '1e-3'\ntis_cap: null\n")
    r = load_recipe(str(path))
    assert (r.steps, r.temperature, r.lr, r.tis_cap, r.name) == (3, 1.0, 1e-3, None, "default")
    assert type(r.temperature) is float  # YAML's int 1 widened: float fields stay floats


@pytest.mark.parametrize("arg,message", [
    ("default.py", "recipe file default.py does not exist (a shipped recipe is named without .py: --recipe default)"),
    ("notes.txt", "recipe 'notes.txt': pass a recipe name (default, lora, qwen3_gpu, tool_use), a .py file"),
    ("missing.yaml", "recipe file missing.yaml does not exist"),
    ("nope", "no recipe 'nope': expected recipes/nope.py"),
])
def test_recipe_names_that_are_no_recipe(arg, message):
    with pytest.raises(ValueError) as exc:
        load_recipe(arg)
    assert str(exc.value).startswith(message), str(exc.value)


@pytest.mark.parametrize("field,text,expected", [
    ("steps", "1e3", 1000), ("steps", "2.0", 2), ("steps", "0x10", 16), ("steps", "08", 8), ("seed", "0xe", 14),
    ("tis_cap", "none", None), ("off_policy", "yes", True), ("task_args", '{"max_operand": 3}', {"max_operand": 3}),
])
def test_flag_values_parse(field, text, expected):
    assert getattr(with_overrides(Recipe(), {field: text}), field) == expected


@pytest.mark.parametrize("field,text,message", [
    ("steps", "1.5e0", "--steps: cannot read '1.5e0' as int"),  # not cut to 1
    ("temperature", "0", "temperature must be a finite number > 0"),  # greedy: n identical samples
    ("n_per_prompt", "0", "n_per_prompt must be >= 2 (GRPO compares samples of one prompt), got 0"),
    ("max_new_tokens", "0", "max_new_tokens must be >= 1, got 0"),
    ("bucket_bytes", "0", "bucket_bytes must be >= 1, got 0"),
    ("lr", "inf", "lr must be a finite number > 0, got inf"),
    ("stpes", "2", "unknown recipe field 'stpes'; did you mean 'steps'?"),
])
def test_bad_flag_values(field, text, message):
    with pytest.raises(ValueError) as exc:
        with_overrides(Recipe(), {field: text})
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_base_chain_that_loops_is_refused(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\nsteps: 1\n")
    b.write_text(f"base: {a}\nlr: 0.01\n")
    with pytest.raises(ValueError) as exc:
        load_recipe(str(a))
    assert str(exc.value) == f"recipe file {a}: recipe file {b}: the base: chain comes back to {a} ({a} -> {b} -> {a})"
    b.write_text("base: default\nlr: 0.01\n")
    r = load_recipe(str(a))
    assert (r.steps, r.lr, r.prompts_per_step) == (1, 0.01, 32)  # a over b over default
