"""RolloutManager: the samples of a batch of prompts, generated over several engines.

Each prompt's n samples go to one engine as one request with `n` (distinct derived seeds; the
samples share the prompt's KV through the radix cache), so a GRPO group never splits. Which engine:
rollout/router.py, prefix locality with bounded loads (prompts sharing their first `route_prefix`
tokens meet on one engine while its load stays within (1 + balance_slack) x the mean; beyond that,
and for unseen prefixes, the least-loaded engine). Over-sampling: with `keep_groups`, the first keep_groups
prompts whose samples all finish are kept and the rest aborted, so a long tail does not hold up
the step (dynamic sampling as slime and DAPO do it). Engines are any engine.api.protocol.EngineAPI
(an in-process Engine, engine_client's HttpClient or RayClient, mixed as you like).

Failures: a group whose engine is unreachable (a ConnectionError: down, connection dropped, 503)
goes to another engine it has not tried, so one dead replica of several costs a retry, not the
step. Any other error, or every engine unreachable, fails the batch: the other groups are aborted
on their engines and cancelled (nothing keeps generating for nobody), and the error says which
group and engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any, Callable, Optional, Sequence

from engine.api.protocol import EngineAPI
from rollout.router import PrefixRouter
from rollout.types import Sample

logger = logging.getLogger("tandem")
ABORT_TIMEOUT_S = 10.0  # an abort to an engine that answers nothing must not hold up the error


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
        self._unreachable: set[int] = set()  # engines whose failure was logged (once, not per group)

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
        extra = {"return_routed_experts": True} if self.return_routed_experts else {}
        if lora_path is not None:
            extra["lora_path"] = lora_path
        tasks, where = {}, {}  # where: group -> the index of the engine it is on now
        ended: set[int] = set()  # groups this batch aborted: never sent again (a retry would run in full)
        for g, (prompt, params) in enumerate(zip(prompts, per_prompt)):
            request = dict(input_ids=list(prompt), return_logprob=True, sampling_params={**params, "n": n},
                           rid=f"{batch}-{g}", **extra)
            where[g] = self.router.pick(prompt, n)
            task = asyncio.ensure_future(self._run_group(g, request, where, ended))
            # a callback, not a finally: it runs for a task cancelled before it started, too
            task.add_done_callback(lambda _, g=g: self.router.release(where[g], n))
            tasks[task] = g
        kept = await self._collect(tasks, where, ended, keep_groups, n, batch)
        groups = []
        for g in sorted(kept):
            samples = [Sample.from_output(out, g, i, list(prompts[g]), labels[g]) for i, out in enumerate(kept[g])]
            if self.reward_fn is not None:
                for s in samples:
                    s.reward = float(self.reward_fn(s))
            groups.append(samples)
        return groups

    async def _run_group(self, g: int, request: dict, where: dict, ended: set) -> list[dict]:
        """One group on engine where[g]; while engines are unreachable, on another not yet tried
        (not once the batch has aborted it)."""
        n, tried = request["sampling_params"]["n"], []
        while True:
            index = where[g]
            try:
                out = await _generate_group(self.engines[index], **request)
                self._unreachable.discard(index)
                return out
            except ConnectionError as exc:
                tried.append(index)
                if g in ended:  # aborted by the batch meanwhile: its abort never reaches a new engine
                    raise
                if len(tried) == len(self.engines):
                    exc.add_note(f"rollout group {g}: every engine ({len(tried)}) was unreachable")
                    raise
                if index not in self._unreachable:
                    self._unreachable.add(index)
                    logger.warning("rollout: engine %d unreachable (%s); its groups go to the others", index, exc)
            except Exception as exc:
                exc.add_note(f"rollout group {g}, on engine {index} ({_name(self.engines[index])})")
                raise
            self.router.release(index, n)
            where[g] = self.router.pick(request["input_ids"], n, exclude=tried)

    async def _collect(self, tasks: dict, where: dict, ended: set, keep_groups: Optional[int], n: int,
                       batch: str) -> dict[int, list]:
        """tasks: future -> group. -> group -> its n outputs, for the kept groups. A failed group
        (or this rollout cancelled, as by Ctrl-C) aborts and cancels the rest, then raises."""
        wanted = keep_groups or len(tasks)
        kept: dict[int, list] = {}
        pending = set(tasks)
        try:
            while pending and len(kept) < wanted:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=lambda t: tasks[t]):
                    if len(kept) < wanted:
                        kept[tasks[t]] = t.result()  # a failed group raises here
        except BaseException:
            await self._abort([t for t in tasks if not t.done()], tasks, where, ended, n, batch, cancel=True)
            for t in tasks:  # retrieved: no "Task exception was never retrieved" for the others
                if not t.cancelled():
                    t.exception()
            raise
        if pending:  # the long tail: abort it, then wait until each engine has let it go
            await self._abort(list(pending), tasks, where, ended, n, batch, cancel=False)
        return kept

    async def _abort(self, pending: list, tasks: dict, where: dict, ended: set, n: int, batch: str,
                     cancel: bool) -> None:
        """Abort the pending groups on their engines by rid, all at once (an engine's failures are
        logged once), then wait for them; cancel: cancel them first (a failing batch: an
        HttpClient's cancelled request closes its connection, which aborts it on the server too)."""
        ended.update(tasks[t] for t in pending)
        rids = [(where[tasks[t]], rid) for t in pending
                for rid in ([f"{batch}-{tasks[t]}"] if n == 1 else [f"{batch}-{tasks[t]}-{i}" for i in range(n)])]
        failed = await asyncio.gather(*[_abort_rid(self.engines[i], rid) for i, rid in rids])
        for i in sorted({i for (i, _), exc in zip(rids, failed) if exc is not None}):
            first = next(exc for (j, _), exc in zip(rids, failed) if j == i and exc is not None)
            logger.warning("rollout: aborting on engine %d (%s) failed: %s", i, _name(self.engines[i]), first)
        for t in pending if cancel else ():
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _abort_rid(engine: Any, rid: str) -> Optional[Exception]:
    try:
        await asyncio.wait_for(engine.async_abort_request(rid), ABORT_TIMEOUT_S)
    except Exception as exc:  # unreachable: nothing left running there to abort
        return exc
    return None


async def _generate_group(engine: Any, **request: Any) -> list[dict]:
    out = await engine.async_generate(**request)
    return out if isinstance(out, list) else [out]


def _name(engine: Any) -> str:
    return getattr(engine, "base_url", None) or type(engine).__name__
