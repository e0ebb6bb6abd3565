"""The supervised warm start: a few steps of cross-entropy on the task's own answers.

A random tiny model never writes an answer, so every GRPO group would score 0 and teach nothing;
a short warm start gets it to partial reward, which RL then raises. A task may define
`demonstrations(problem) -> [(context, target, ends_turn)]` (a tool-use task shows the call and
the copy); by default the demonstration is (prompt, answer, True). A target that ends the turn
is followed by the end token.
"""

from __future__ import annotations

import random
from typing import Any

from recipes.recipe import Recipe
from rollout.tasks import draw_problems


def demonstrations(task: Any, problem: Any) -> list[tuple[str, str, bool]]:
    if hasattr(task, "demonstrations"):
        return list(task.demonstrations(problem))
    return [(problem.prompt, problem.answer, True)]


def warm_start(trainer: Any, task: Any, tokenizer: Any, recipe: Recipe) -> list[float]:
    """recipe.warm_start_steps supervised steps of recipe.warm_start_batch problems -> the losses."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the warm start needs the tokenizer's eos token (none is set)")
    rng = random.Random(f"{recipe.seed}-warm-start")
    losses = []
    for _ in range(recipe.warm_start_steps):
        contexts, targets = [], []
        for problem in draw_problems(task, rng, recipe.warm_start_batch, recipe.task):
            for context, target, ends in demonstrations(task, problem):
                contexts.append(tokenizer.encode(context, add_special_tokens=False))
                targets.append(tokenizer.encode(target, add_special_tokens=False) + ([eos] if ends else []))
        metrics = trainer.supervised_step(contexts, targets, recipe.warm_start_lr)
        losses.append(metrics["loss"])
    return losses
