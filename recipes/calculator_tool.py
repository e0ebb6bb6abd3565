"""A toy tool: the model may ask a calculator, whose answer is appended to its context.

Format: prompt "3+4="; the model writes "?" (the call: "calculate the expression before '='");
the environment appends "7;" (the result and a separator, loss mask 0); the model then writes
its answer "7" and the end token. A sample that never calls answers directly, in one turn. The
reward is exact match on the last turn's text, so a policy that calls and copies scores 1.

`calculator_rollout` is the rollout_fn plug-in (recipes/multi_turn.py); `CalculatorAddition`
is the task, whose demonstrations (for the warm start) show the call, then the copy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recipes.multi_turn import MultiTurnSample, Transcript, TurnContext
from rollout.tasks import Addition, Problem

CALL = "?"
RESULT_END = ";"


@dataclass(frozen=True)
class CalculatorAddition:
    max_operand: int = 9

    def problems(self, rng: random.Random, count: int) -> list[Problem]:
        return Addition(self.max_operand).problems(rng, count)

    def demonstrations(self, problem: Problem) -> list[tuple[str, str, bool]]:
        """(context, target, ends the turn) triples teaching the call, then the copy of the result."""
        return [(problem.prompt, CALL, False),
                (problem.prompt + CALL + tool_result(problem.prompt), problem.answer, True)]


def calculator_addition(max_operand: int = 9) -> CalculatorAddition:
    return CalculatorAddition(max_operand)


def tool_result(prompt: str) -> str:
    """What the calculator answers for "a+b=": "<a+b>;"."""
    left, right = prompt.rstrip("=").split("+")
    return f"{int(left) + int(right)}{RESULT_END}"


async def calculator_rollout(ctx: TurnContext) -> MultiTurnSample:
    """Turn 1 stops at the call token; if the model called, the result is appended (mask 0) and
    turn 2 answers within what is left of max_new_tokens."""
    call_id = _single_token(ctx.tokenizer, CALL)
    budget = ctx.sampling_params["max_new_tokens"]
    transcript = Transcript(ctx.prompt_ids)
    first = await ctx.engine.async_generate(
        input_ids=transcript.context, return_logprob=True, rid=f"{ctx.rid}-t0",
        sampling_params={**ctx.sampling_params, "stop_token_ids": [call_id]})
    turn = transcript.add_model_turn(first)
    called = bool(turn.response_ids) and turn.response_ids[-1] == call_id
    left = budget - sum(transcript.mask)
    if called and left > 0:
        prompt_text = ctx.tokenizer.decode(ctx.prompt_ids)
        transcript.add_env_tokens(ctx.tokenizer.encode(tool_result(prompt_text), add_special_tokens=False))
        second = await ctx.engine.async_generate(
            input_ids=transcript.context, return_logprob=True, rid=f"{ctx.rid}-t1",
            sampling_params={**ctx.sampling_params, "max_new_tokens": left,
                             "sampling_seed": ctx.sampling_params["sampling_seed"] + 1})
        transcript.add_model_turn(second)
    elif called:
        transcript.status = "truncated"  # called with no budget left to answer
    return transcript.to_sample(ctx, text=transcript.last_text if not called or left > 0 else "",
                                called_tool=called)


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the calculator's call marker {text!r} must be one token of this tokenizer; got {ids}")
    return ids[0]
