"""Workload: the requests a benchmark sends, drawn from a seeded generator.

Prompts are random token ids within the vocabulary and every request has a fixed output length
(sent with ignore_eos), so the token counts of a run are known before it starts. Lengths follow
SGLang's `--random-range-ratio`: uniform integers in [ratio * len, len].
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

WORKLOADS = ("random", "grpo")


@dataclass(frozen=True)
class Workload:
    kind: str
    input_ids: list[list[int]]  # one per request; grpo repeats each prompt n times, adjacently
    output_lens: list[int]
    n: int  # samples per distinct prompt (1 for random)
    temperature: float = 0.0  # 0: greedy, so the HF comparison can check the tokens; RL samples at 1
    lora_paths: Optional[list[str]] = None  # each request's LoRA adapter (None: the base model)

    def head(self, n: Optional[int]) -> "Workload":
        """The first n requests (all when n is None)."""
        if n is None:
            return self
        lora = None if self.lora_paths is None else self.lora_paths[:n]
        return dataclasses.replace(self, input_ids=self.input_ids[:n], output_lens=self.output_lens[:n],
                                   lora_paths=lora)

    def with_adapters(self, lora_paths: Optional[list[str]]) -> "Workload":
        return dataclasses.replace(self, lora_paths=lora_paths)

    @property
    def num_requests(self) -> int:
        return len(self.input_ids)

    @property
    def num_prompts(self) -> int:
        return self.num_requests // self.n

    @property
    def input_lens(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    @property
    def unique_input_lens(self) -> list[int]:
        """Prompt lengths counting each shared grpo prompt once: what prefill must compute."""
        return self.input_lens[:: self.n]

    @property
    def total_input_tokens(self) -> int:
        return sum(self.input_lens)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self) -> list[dict]:
        return [{"max_new_tokens": n, "temperature": self.temperature, "ignore_eos": True}
                for n in self.output_lens]

    def describe(self) -> dict:
        return {
            "kind": self.kind, "num_prompts": self.num_prompts, "n": self.n,
            "temperature": self.temperature,
            "num_requests": self.num_requests,
            "input_tokens": self.total_input_tokens, "output_tokens": self.total_output_tokens,
            "mean_input_len": self.total_input_tokens / self.num_requests,
            "mean_output_len": self.total_output_tokens / self.num_requests,
            "lora_adapters": len(set(self.lora_paths)) if self.lora_paths else 0,
        }


def build_workload(kind: str, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                   range_ratio: float = 1.0, n: int = 1, seed: int = 0,
                   temperature: float = 0.0) -> Workload:
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {kind!r}")
    if kind == "random" and n != 1:
        raise ValueError("--n applies to the grpo workload; the random workload sends one sample per prompt")
    if min(num_prompts, input_len, output_len, n) < 1:
        raise ValueError("num_prompts, input_len, output_len and n must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1], got {range_ratio}")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(length)]
               for length in _lengths(rng, input_len, range_ratio, num_prompts)]
    input_ids = [ids for ids in prompts for _ in range(n)]
    output_lens = _lengths(rng, output_len, range_ratio, len(input_ids))
    return Workload(kind, input_ids, output_lens, n, temperature)


def _lengths(rng: random.Random, length: int, ratio: float, count: int) -> list[int]:
    low = max(int(length * ratio), 1)  # SGLang's bench_serving bounds, inclusive
    return [rng.randint(low, length) for _ in range(count)]
