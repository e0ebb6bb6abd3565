"""Rollouts: one step's groups of samples, scored, from the recipe's task over the engines.

Prompts come from the task with a generator seeded by (recipe seed, step), so a run replays;
each prompt's n samples get distinct seeds (the engine derives them from the prompt's seed).
Single-turn rollouts are one request per prompt with `n` through rollout.RolloutManager; a
recipe's `rollout_fn` plug-in (recipes/multi_turn.py) instead runs once per sample and may call
its engine several times.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from recipes.multi_turn import RolloutFn, TurnContext
from recipes.recipe import Recipe
from rollout.manager import RolloutManager
from rollout.plugins import plugin_error
from rollout.rewards import checked_reward
from rollout.tasks import draw_problems
from rollout.types import Sample
from trainer_bridge.trainable_lora import ADAPTER_NAME


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
        self.reward_fn = checked_reward(reward_fn, recipe.reward)  # a float in [0, 1], or the run stops
        self.rollout_fn = rollout_fn
        self.manager = RolloutManager(engines, reward_fn=self.reward_fn,
                                      return_routed_experts=recipe.routed_experts != "off")
        self._tag = uuid.uuid4().hex[:8]  # request ids stay unique across runs on the same engines
        self.lora_path = ADAPTER_NAME if recipe.lora_rank else None  # LoRA RL: the pushed adapter

    def generate(self, step: int) -> RolloutResult:
        """Blocking; call from a thread without a running event loop."""
        return asyncio.run(self.agenerate(step))

    async def agenerate(self, step: int) -> RolloutResult:
        start = time.perf_counter()
        rng = random.Random(f"{self.recipe.seed}-prompts-{step}")
        problems = draw_problems(self.task, rng, self.recipe.prompts_per_step, self.recipe.task)
        prompts = [self.tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems]
        params = [self._sampling_params(step, g) for g in range(len(problems))]
        if self.rollout_fn is None:
            groups = await self.manager.agenerate(prompts, params, n=self.recipe.n_per_prompt,
                                                  labels=[p.answer for p in problems], lora_path=self.lora_path)
        else:
            groups = await self._plugin_groups(step, problems, prompts, params)
        check_not_failed([s for g in groups for s in g], step)
        return RolloutResult(groups, time.perf_counter() - start)

    def abort(self) -> None:
        """End every request in flight on every engine (the run is stopping): the rollout thread
        then finishes at once instead of generating a step nobody will train on."""
        for engine in self.manager.engines:
            try:
                engine.abort_request(abort_all=True)
            except Exception:  # an engine already gone has nothing left to abort
                pass

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
                calls.append(self._call_plugin(ctx))
        samples = await asyncio.gather(*calls)
        n = self.recipe.n_per_prompt
        groups = [list(samples[g * n:(g + 1) * n]) for g in range(len(problems))]
        for group in groups:
            for s in group:
                s.reward = float(self.reward_fn(s))
        return groups

    async def _call_plugin(self, ctx: TurnContext) -> Sample:
        """The rollout_fn on one sample; its errors and a result that is no Sample name it."""
        path = self.recipe.rollout_fn
        try:
            pending = self.rollout_fn(ctx)
            sample = await pending if inspect.isawaitable(pending) else pending
        except Exception as exc:
            raise plugin_error("rollout_fn", path, exc) from exc
        if not isinstance(sample, Sample):
            fix = ("build one with recipes.multi_turn.Transcript.to_sample" if inspect.isawaitable(pending)
                   else "it must be an async function, `async def fn(ctx) -> Sample`")
            raise ValueError(f"rollout_fn {path!r} returned {type(sample).__name__}, not a Sample: {fix}")
        return sample


def check_not_failed(samples: list[Sample], step: int) -> None:
    """An engine that failed a request aborts it with "engine error: ..." (its log has the
    traceback): training on the partial responses would be wrong, and if every sample was
    aborted the step would only report an empty batch. Either is one line with the engine's why."""
    for s in samples:
        reason = s.metadata.get("finish_reason")
        message = reason.get("message") if isinstance(reason, dict) else None
        if s.status == "aborted" and isinstance(message, str) and message.startswith("engine error"):
            raise ValueError(f"step {step}: an engine failed a rollout ({message}); its log above has the traceback")
    if samples and all(s.status == "aborted" for s in samples):
        raise ValueError(f"step {step}: the engines aborted every rollout; their log above says why")
