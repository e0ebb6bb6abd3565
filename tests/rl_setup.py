"""Shared settings of the tests that run tiny engines in-process, behind Ray or over HTTP (the
fixtures using them are in tests/conftest.py)."""

from __future__ import annotations

# Every engine here runs the deterministic mode, so the trainer's Policy recomputes the engine's
# rollout logprobs bit for bit and greedy tokens of two engines on one checkpoint agree exactly.
ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "enable_deterministic_inference": True}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [300, 12, 800, 9, 77]]


def greedy_ids(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
