"""Plug-ins are the user's code: a task, reward or module that fails is one ValueError naming the
recipe field, the dotted path and the line, and a reward must answer a finite float in [0, 1]."""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest
import torch

from rollout.plugins import check_arity, load_object
from rollout.rewards import checked_reward
from rollout.tasks import Problem, addition, draw_problems, load_task
from rollout.types import Sample


def _sample(text: str = "7") -> Sample:
    return Sample(0, 0, [1, 2], [3], [-0.5], ["0"], "completed", text=text, label="7")


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder the test writes plug-in modules into, as the working directory and not on sys.path
    (the `tandem` script's sys.path starts at its bin/ folder)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def test_a_module_in_the_working_directory_imports(plugin_dir):
    (plugin_dir / "cwd_plug_a.py").write_text("def score(sample):\n    return 1.0\n")
    assert load_object("cwd_plug_a:score", "reward")(_sample()) == 1.0
    assert sys.path[-1] == str(plugin_dir)  # appended: installed packages keep precedence


def test_a_module_that_fails_to_import_names_the_line(plugin_dir):
    (plugin_dir / "cwd_plug_b.py").write_text("x = 1\ndef score(sample:\n")
    with pytest.raises(ValueError) as exc:
        load_object("cwd_plug_b:score", "reward")
    assert str(exc.value) == (f"reward 'cwd_plug_b:score': {plugin_dir / 'cwd_plug_b.py'}, line 2: SyntaxError: "
                              f"'(' was never closed")
    (plugin_dir / "cwd_plug_c.py").write_text("\nraise RuntimeError('no dataset')\n")
    with pytest.raises(ValueError) as exc:
        load_object("cwd_plug_c:make", "task")
    assert str(exc.value) == ("task 'cwd_plug_c:make' raised RuntimeError while importing: no dataset "
                              "(cwd_plug_c.py, line 2)")


def test_rewards_must_be_finite_floats_in_0_1():
    for value in (0, 1, True, 0.5, np.float32(0.25), torch.tensor(0.75)):
        assert checked_reward(lambda s, v=value: v, "r:ok")(_sample()) == float(value)
    for value, shown in ((5.0, "5.0"), (-1, "-1.0"), (math.nan, "nan"), (math.inf, "inf")):
        with pytest.raises(ValueError) as exc:
            checked_reward(lambda s, v=value: v, "my:reward")(_sample())
        assert str(exc.value) == (f"reward 'my:reward' returned {shown} for the response '7': a reward is a float "
                                  f"in [0, 1]")
    for value, kind in ((None, "NoneType"), ("good", "str"), ([1.0], "list"), (torch.ones(2), "Tensor")):
        with pytest.raises(ValueError, match=rf"reward 'my:reward' returned .* \({kind}\) for the response '7'"):
            checked_reward(lambda s, v=value: v, "my:reward")(_sample())


def test_a_reward_that_raises_names_itself_and_the_response():
    def broken(sample):
        return {}["score"]

    with pytest.raises(ValueError) as exc:
        checked_reward(broken, "my:broken")(_sample("42"))
    assert str(exc.value).startswith("reward 'my:broken' raised KeyError on the response '42': 'score' (")
    assert str(exc.value).endswith(f"test_plugins.py, line {broken.__code__.co_firstlineno + 1})")
    assert isinstance(exc.value.__cause__, KeyError)  # TANDEM_DEBUG=1 shows it


def test_arity():
    check_arity(lambda sample: 1.0, "reward", "a:b", "the Sample")
    with pytest.raises(ValueError, match=r"reward 'a:b' must take one argument \(the Sample\); its signature is "
                                         r"two\(s, t\)"):
        def two(s, t):
            return 1.0
        check_arity(two, "reward", "a:b", "the Sample")


def test_task_factories_and_their_arguments():
    assert load_task("rollout.tasks:addition", {"max_operand": 3}).max_operand == 3
    with pytest.raises(ValueError) as exc:
        load_task("rollout.tasks:addition", {"nope": 1})
    assert str(exc.value) == ("task 'rollout.tasks:addition' does not take task_args {'nope': 1}: got an unexpected "
                              "keyword argument 'nope' (set --task-args to its arguments, '{}' for none)")
    with pytest.raises(ValueError, match=r"^task 'rollout.tasks:addition': max_operand must be an integer >= 0, "
                                         r"got -1 \("):
        load_task("rollout.tasks:addition", {"max_operand": -1})
    with pytest.raises(ValueError, match="^task 'rollout.plugins:load_object' does not take task_args"):
        load_task("rollout.plugins:load_object", {})
    with pytest.raises(ValueError, match=r"^task 'math:floor' does not take task_args \{\}"):
        load_task("math:floor", {})  # (a builtin with a signature that needs an argument)


class _Task:
    def __init__(self, problems):
        self._problems = problems

    def problems(self, rng, count):
        if isinstance(self._problems, Exception):
            raise self._problems
        return self._problems


def test_drawn_problems_are_checked():
    rng = random.Random(0)
    assert draw_problems(addition(2), rng, 3, "t:add") == addition(2).problems(random.Random(0), 3)
    cases = [(_Task([Problem("1+1=", "2")]), "task 't:x': problems(rng, 2) returned 1 problems, not 2"),
             (_Task(["1+1=", "2+2="]), "task 't:x': problems() must return Problem(prompt: str, answer) items; "
                                       "got '1+1='"),
             (_Task(IndexError("row 9")), "task 't:x' raised IndexError in problems(): row 9 (")]
    for task, message in cases:
        with pytest.raises(ValueError) as exc:
            draw_problems(task, rng, 2, "t:x")
        assert str(exc.value).startswith(message), str(exc.value)
