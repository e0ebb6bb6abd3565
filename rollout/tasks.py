"""Synthetic tasks whose answers a program checks: prompts, labels and supervised examples.

A task is anything with `problems(rng, count) -> list[Problem]`; a recipe names its factory by a
dotted path ("rollout.tasks:addition"), and its reward function checks a Sample's text against
the Problem's answer (the Sample's label). Formats suit the tiny model's tokenizer, which splits
numbers into single digits: "3+4=" is four tokens and the answer "7" one.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Any

from rollout.plugins import load_object, plugin_error


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class Addition:
    """a+b= with operands in [0, max_operand]: (max_operand + 1)^2 distinct problems."""

    max_operand: int = 9

    def __post_init__(self) -> None:
        if not isinstance(self.max_operand, int) or self.max_operand < 0:
            raise ValueError(f"max_operand must be an integer >= 0, got {self.max_operand!r}")

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            out.append(Problem(f"{a}+{b}=", str(a + b)))
        return out


@dataclass(frozen=True)
class Copy:
    """"copy 3 1 4:" -> "314": repeat `length` digits."""

    length: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length must be an integer >= 1, got {self.length!r}")

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        out = []
        for _ in range(count):
            digits = [str(rng.randint(0, 9)) for _ in range(self.length)]
            out.append(Problem(f"copy {' '.join(digits)}:", "".join(digits)))
        return out


def addition(max_operand: int = 9) -> Addition:
    return Addition(max_operand)


def copy(length: int = 3) -> Copy:
    return Copy(length)


def load_task(path: str, args: dict) -> Any:
    """The task factory at `path` called with `args` (a recipe's task and task_args) -> the task.
    Arguments the factory does not take, a factory that raises, or a result without `problems`
    are one ValueError naming the task."""
    factory = load_object(path, "task")
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        raise ValueError(f"task {path!r} does not take task_args {args}: {exc} (set --task-args to its "
                         f"arguments, '{{}}' for none)") from None
    except ValueError:  # no signature to read (a builtin): let the call decide
        pass
    try:
        task = factory(**args)
    except Exception as exc:
        raise plugin_error("task", path, exc) from exc
    if not callable(getattr(task, "problems", None)):
        raise ValueError(f"task {path!r} returned {type(task).__name__}, which has no problems(rng, count) method")
    return task


def draw_problems(task: Any, rng: random.Random, count: int, path: str) -> list[Problem]:
    """task.problems(rng, count), checked: exactly `count` items, each with a str prompt and an answer."""
    try:
        problems = list(task.problems(rng, count))
    except Exception as exc:
        raise plugin_error("task", path, exc, "in problems()") from exc
    if len(problems) != count:
        raise ValueError(f"task {path!r}: problems(rng, {count}) returned {len(problems)} problems, not {count}")
    for p in problems:
        if not isinstance(getattr(p, "prompt", None), str) or not hasattr(p, "answer"):
            raise ValueError(f"task {path!r}: problems() must return Problem(prompt: str, answer) items; got {p!r}")
    return problems
