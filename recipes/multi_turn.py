"""Multi-turn rollouts: a rollout function plug-in may call the engine several times per sample.

A recipe's `rollout_fn` names `async def fn(ctx: TurnContext) -> Sample` by a dotted path. It
generates from `ctx.engine` (the engine this prompt routes to) with `ctx.sampling_params` (a
seed of its own per sample), appends whatever the environment answers, and returns a
`MultiTurnSample` built with a `Transcript`: every token the policy produced has loss mask 1 and
its rollout logprob and weight version; every token the environment wrote (a tool's result) has
mask 0, logprob 0.0 and weight version "" and is never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rollout.types import Sample

ENV_VERSION = ""  # the weight version of tokens no policy produced


@dataclass
class MultiTurnSample(Sample):
    mask: list[int] = field(default_factory=list)

    @property
    def loss_mask(self) -> list[int]:
        return self.mask


@dataclass(frozen=True)
class TurnContext:
    engine: Any  # an engine.api.protocol.EngineAPI
    tokenizer: Any
    prompt_ids: list[int]
    problem: Any  # the task's Problem (prompt, answer)
    sampling_params: dict  # temperature, max_new_tokens (the budget for all turns), sampling_seed
    group: int
    index: int
    rid: str  # unique per sample; add a turn suffix per call


class Transcript:
    """The response of a multi-turn sample, built turn by turn."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[str] = []
        self.status = "completed"
        self.last_text = ""

    @property
    def context(self) -> list[int]:
        """Prompt + everything so far: the next turn's input."""
        return self.prompt_ids + self.ids

    def add_model_turn(self, out: dict) -> Sample:
        """An engine output dict (return_logprob=True) -> its tokens, trained on (mask 1)."""
        turn = Sample.from_output(out, 0, 0, self.context)
        self.ids += turn.response_ids
        self.mask += [1] * len(turn.response_ids)
        self.logprobs += turn.rollout_logprobs
        self.versions += turn.weight_versions
        self.status = turn.status
        self.last_text = turn.text
        return turn

    def add_env_tokens(self, ids: list[int]) -> None:
        """Tokens the environment wrote (a tool result): context for the model, never trained on."""
        self.ids += list(ids)
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [ENV_VERSION] * len(ids)

    def to_sample(self, ctx: TurnContext, text: str, **metadata: Any) -> MultiTurnSample:
        return MultiTurnSample(ctx.group, ctx.index, self.prompt_ids, self.ids, self.logprobs, self.versions,
                               self.status, text=text, label=ctx.problem.answer, metadata=metadata,
                               mask=self.mask)


RolloutFn = Callable[[TurnContext], Awaitable[Sample]]
