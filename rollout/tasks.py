"""Synthetic tasks whose answers a program checks: prompts, labels and supervised examples.

A task is anything with `problems(rng, count) -> list[Problem]`; a recipe names its factory by a
dotted path ("rollout.tasks:addition"), and its reward function checks a Sample's text against
the Problem's answer (the Sample's label). Formats suit the tiny model's tokenizer, which splits
numbers into single digits: "3+4=" is four tokens and the answer "7" one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class Addition:
    """a+b= with operands in [0, max_operand]: (max_operand + 1)^2 distinct problems."""

    max_operand: int = 9

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
