"""Rollouts: one step's groups of samples, scored, from the recipe's task over the engines.

Prompts come from the task with a generator seeded by (recipe seed, step), so a run replays;
each prompt's n samples get distinct seeds (the engine derives them from the prompt's seed).
Single-turn rollouts are one request per prompt with `n` through rollout.RolloutManager; a
recipe's `rollout_fn` plug-in (recipes/multi_turn.py) instead runs once per sample and may call
its engine several times.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from recipes.multi_turn import RolloutFn, TurnContext
from recipes.recipe import Recipe
from rollout.manager import RolloutManager
from rollout.types import Sample


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    seconds: float

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    @property
    def generated_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.samples)


class Rollouts:
    def __init__(self, recipe: Recipe, engines: list[Any], tokenizer: Any, task: Any,
                 reward_fn: Callable[[Sample], float], rollout_fn: Optional[RolloutFn] = None) -> None:
        self.recipe = recipe
        self.tokenizer = tokenizer
        self.task = task
        self.reward_fn = reward_fn
        self.rollout_fn = rollout_fn
        self.manager = RolloutManager(engines, reward_fn=reward_fn)
        self._tag = uuid.uuid4().hex[:8]  # request ids stay unique across runs on the same engines

    def generate(self, step: int) -> RolloutResult:
        """Blocking; call from a thread without a running event loop."""
        return asyncio.run(self.agenerate(step))

    async def agenerate(self, step: int) -> RolloutResult:
        start = time.perf_counter()
        problems = self.task.problems(random.Random(f"{self.recipe.seed}-prompts-{step}"), self.recipe.prompts_per_step)
        prompts = [self.tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
        params = [self._sampling_params(step, g) for g in range(len(problems))]
        if self.rollout_fn is None:
            groups = await self.manager.agenerate(prompts, params, n=self.recipe.n_per_prompt,
                                                  labels=[p.answer for p in problems])
        else:
            groups = await self._plugin_groups(step, problems, prompts, params)
        return RolloutResult(groups, time.perf_counter() - start)

    def _sampling_params(self, step: int, group: int) -> dict:
        seed = random.Random(f"{self.recipe.seed}-sampling-{step}-{group}").getrandbits(62)
        return {"temperature": self.recipe.temperature, "max_new_tokens": self.recipe.max_new_tokens,
                "sampling_seed": seed}

    async def _plugin_groups(self, step: int, problems: list, prompts: list, params: list) -> list[list[Sample]]:
        calls = []
        for g, (problem, prompt, base) in enumerate(zip(problems, prompts, params)):
            engine = self.manager.engines[self.manager.route(prompt)]
            for i in range(self.recipe.n_per_prompt):
                sample_params = {**base, "sampling_seed": (base["sampling_seed"] + 7919 * i) % (1 << 62)}
                ctx = TurnContext(engine, self.tokenizer, list(prompt), problem, sample_params, g, i,
                                  rid=f"turns-{self._tag}-{step}-{g}-{i}")
                calls.append(self.rollout_fn(ctx))
        samples = await asyncio.gather(*calls)
        n = self.recipe.n_per_prompt
        groups = [list(samples[g * n:(g + 1) * n]) for g in range(len(problems))]
        for group in groups:
            for s in group:
                s.reward = float(self.reward_fn(s))
        return groups
