"""RolloutManager: the samples of a batch of prompts, generated over several engines.

Each prompt's n samples go to one engine as one request with `n` (distinct derived seeds; the
samples share the prompt's KV through the radix cache), so a GRPO group never splits. Which engine:
rollout/router.py, prefix locality with bounded loads (prompts sharing their first `route_prefix`
tokens meet on one engine while its load stays within (1 + balance_slack) x the mean; beyond that,
and for unseen prefixes, the least-loaded engine). Over-sampling: with `keep_groups`, the first keep_groups
prompts whose samples all finish are kept and the rest aborted, so a long tail does not hold up
the step (dynamic sampling as slime and DAPO do it). Engines are any engine.api.protocol.EngineAPI
(an in-process Engine, engine_client's HttpClient or RayClient, mixed as you like).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Callable, Optional, Sequence

from engine.api.protocol import EngineAPI
from rollout.router import PrefixRouter
from rollout.types import Sample


class RolloutManager:
    def __init__(self, engines: Sequence[EngineAPI], reward_fn: Optional[Callable[[Sample], float]] = None,
                 route_prefix: int = 64, balance_slack: float = 0.25, return_routed_experts: bool = False) -> None:
        """return_routed_experts: ask the (MoE) engines for every sample's routes (Sample.routed_experts);
        they must run with --enable-return-routed-experts."""
        if not engines:
            raise ValueError("RolloutManager needs at least one engine")
        self.engines = list(engines)
        self.return_routed_experts = return_routed_experts
        self.reward_fn = reward_fn
        self.router = PrefixRouter(len(self.engines), route_prefix, balance_slack)
        self._batch_ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]

    def route(self, prompt_ids: Sequence[int]) -> int:
        """The engine index a prompt's prefix hashes to: where it goes while loads are even."""
        return self.router.preferred(prompt_ids)

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: Any, n: int = 1,
                 labels: Optional[Sequence[Any]] = None, keep_groups: Optional[int] = None) -> list[list[Sample]]:
        """-> one list of n Samples per kept prompt, in prompt order. sampling_params: one dict
        for all prompts or one per prompt. Call from a thread without an event loop; inside one,
        await `agenerate`."""
        return asyncio.run(self.agenerate(prompts, sampling_params, n, labels, keep_groups))

    async def agenerate(self, prompts: Sequence[Sequence[int]], sampling_params: Any, n: int = 1,
                        labels: Optional[Sequence[Any]] = None,
                        keep_groups: Optional[int] = None, lora_path: Optional[str] = None) -> list[list[Sample]]:
        """lora_path: the LoRA adapter every request is generated with (None: the base model)."""
        labels = list(labels) if labels is not None else [None] * len(prompts)
        if len(labels) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(labels)} labels")
        if keep_groups is not None and not 1 <= keep_groups <= len(prompts):
            raise ValueError(f"keep_groups must be in [1, {len(prompts)}], got {keep_groups}")
        per_prompt = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling_params")
        batch = f"rollout-{self._tag}-{next(self._batch_ids)}"
        tasks = {}
        for g, (prompt, params) in enumerate(zip(prompts, per_prompt)):
            index = self.router.pick(prompt, n)
            engine = self.engines[index]
            # submitted inside the task: a refused group fails its task, whose callback still
            # releases the router's count
            extra = {"return_routed_experts": True} if self.return_routed_experts else {}
            if lora_path is not None:
                extra["lora_path"] = lora_path
            task = asyncio.ensure_future(_generate_group(engine, input_ids=list(prompt), return_logprob=True,
                                                         sampling_params={**params, "n": n}, rid=f"{batch}-{g}",
                                                         **extra))
            task.add_done_callback(lambda _, i=index: self.router.release(i, n))
            tasks[task] = (g, engine)
        kept = await self._collect(tasks, keep_groups, n, batch)
        groups = []
        for g in sorted(kept):
            samples = [Sample.from_output(out, g, i, list(prompts[g]), labels[g]) for i, out in enumerate(kept[g])]
            if self.reward_fn is not None:
                for s in samples:
                    s.reward = float(self.reward_fn(s))
            groups.append(samples)
        return groups

    @staticmethod
    async def _collect(tasks: dict, keep_groups: Optional[int], n: int, batch: str) -> dict[int, list]:
        """tasks: future -> (group, engine). -> group -> its n outputs, for the kept groups."""
        if keep_groups is None:
            return {tasks[t][0]: out for t, out in zip(tasks, await asyncio.gather(*tasks))}
        kept: dict[int, list] = {}
        pending = set(tasks)
        while pending and len(kept) < keep_groups:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=lambda t: tasks[t][0]):
                if len(kept) < keep_groups:
                    kept[tasks[t][0]] = t.result()
        for t in pending:  # the long tail: abort it, then wait until each engine has let it go
            g, engine = tasks[t]
            for rid in [f"{batch}-{g}"] if n == 1 else [f"{batch}-{g}-{i}" for i in range(n)]:
                await engine.async_abort_request(rid)
        if pending:
            await asyncio.wait(pending)
        return kept


async def _generate_group(engine: Any, **request: Any) -> list[dict]:
    out = await engine.async_generate(**request)
    return out if isinstance(out, list) else [out]
