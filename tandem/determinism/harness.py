"""The determinism harness: SGLang's test_deterministic modes, against any GenerationClient.

Every request is token-in (random ids from a seeded generator, so dummy weights and
--skip-tokenizer-init work), `ignore_eos` with a fixed `max_new_tokens`, and returns logprobs;
at temperature > 0 all measured requests carry the same `sampling_seed`. A mode passes when every
prompt it measures has exactly 1 unique output (token ids) and the largest logprob difference
is <= `tolerance` (0: bitwise, what --enable-deterministic-inference promises; DESIGN section 4).

Modes (N = trials):
  single  the target prompt sent N times one after another, alone. Unique outputs, and the
          largest |logprob - trial 0's|. (SGLang sends [PROMPT]*bs for bs = 1..N; here the
          request runs alone; trials after the first read the prompt from the radix cache.)
  mixed   the target sent N times, each time in one batch with 1..32 other random requests
          (random lengths up to the target's, random max_new_tokens and sampling params), at a
          random position. Unique outputs of the target and |Δ logprob| vs its first output.
  prefix  prompts that are prefixes of one long random sequence, of lengths chosen to cross the
          attention split sizes (64 on the CPU, 256 on the GPU) and chunked-prefill cuts
          (--prefix-lens; default 1 63 65 255 257 511 1025 2049). Each trial is one batch of
          1..len(lens) such prompts (a random mixture, always including lens[t % len]); the
          cache is flushed before even trials (cold, like SGLang) and kept before odd ones (the
          shared prefix then comes from the radix cache). Unique outputs per prefix length.
  radix   the target run cold (alone, after flush_cache) and then warm (its prompt from the
          radix cache): N warm trials, in waves of 1, 2, 3, ... concurrent copies, each wave
          after its own cold run. Unique outputs over all cold and warm runs, |Δ logprob| vs
          the first cold run; fails if no warm run got cache hits (it would test nothing).
  p_vs_d  the target generated, then prompt + output re-sent with logprob_start_len =
          len(prompt) - 1: the re-read continuation's input_token_logprobs (after the first,
          null, entry) must equal the decoded output_token_logprobs. N trials in waves of
          1, 2, 3, ... . Unique outputs, and the largest |decoded - prefilled| (also over trials).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from tandem.determinism.client import GenerationClient, flush_cache
from tandem.determinism.compare import OutputTally, logprob_values, max_abs_delta

MODES = ("single", "mixed", "prefix", "radix", "p_vs_d")
DEFAULT_PREFIX_LENS = (1, 63, 65, 255, 257, 511, 1025, 2049)
MAX_OTHERS = 32
FIRST_TOKEN_ID = 10  # prompts avoid the lowest ids, where special tokens usually live


@dataclass
class HarnessConfig:
    trials: int = 50
    max_new_tokens: int = 32
    temperature: float = 0.0
    sampling_seed: int = 42
    prompt_len: int = 300
    prefix_lens: tuple[int, ...] = DEFAULT_PREFIX_LENS
    seed: int = 0
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.trials < 1 or self.max_new_tokens < 1 or self.prompt_len < 1:
            raise ValueError("trials, max_new_tokens and prompt_len must be >= 1")
        if not self.prefix_lens or min(self.prefix_lens) < 1:
            raise ValueError("prefix_lens must be positive lengths")


@dataclass
class ModeResult:
    mode: str
    trials: int
    unique: dict[str, int]  # prompt -> unique outputs
    max_delta: float
    passed: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # reasons to fail besides unique / delta

    @property
    def max_unique(self) -> int:
        return max(self.unique.values(), default=0)


class HarnessError(RuntimeError):
    pass


def waves(n: int) -> list[int]:
    """Batch sizes 1, 2, 3, ... summing to n (the last one cut short)."""
    sizes, size = [], 1
    while n > 0:
        sizes.append(min(size, n))
        n -= sizes[-1]
        size += 1
    return sizes


class Harness:
    def __init__(self, client: GenerationClient, config: HarnessConfig) -> None:
        self.client, self.cfg = client, config
        self.info = client.model_info()
        self.vocab = int(self.info["vocab_size"])
        self.rng = random.Random(config.seed)
        self.target = self._random_ids(config.prompt_len)

    def run(self, modes: list[str]) -> list[ModeResult]:
        return [self.run_mode(m) for m in modes]

    def run_mode(self, mode: str) -> ModeResult:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        started = time.perf_counter()
        self.rng = random.Random(f"{self.cfg.seed}:{mode}")  # a mode's batches do not depend on the others
        try:
            result: ModeResult = getattr(self, f"_{mode}")()
        except (HarnessError, ValueError) as exc:  # an aborted or refused request fails the mode
            result = ModeResult(mode, self.cfg.trials, {}, math.inf, failures=[f"{type(exc).__name__}: {exc}"])
        result.seconds = time.perf_counter() - started
        ok = result.max_unique == 1 and result.max_delta <= self.cfg.tolerance
        result.passed = ok and not result.failures
        return result

    # ---- modes ---------------------------------------------------------------------------------
    def _single(self) -> ModeResult:
        tally = OutputTally()
        for _ in range(self.cfg.trials):
            tally.add("target", self._one(self._generate([self.target], [self._params()])[0]))
        return ModeResult("single", self.cfg.trials, tally.unique_counts(), tally.max_delta)

    def _mixed(self) -> ModeResult:
        tally, batch_sizes = OutputTally(), []
        for _ in range(self.cfg.trials):
            k = self.rng.randint(1, MAX_OTHERS)
            others = [self._random_ids(self.rng.randint(1, self.cfg.prompt_len)) for _ in range(k)]
            params = [self._other_params() for _ in range(k)]
            at = self.rng.randrange(k + 1)
            outs = self._generate(others[:at] + [self.target] + others[at:],
                                  params[:at] + [self._params()] + params[at:])
            tally.add("target", self._one(outs[at]))
            batch_sizes.append(k + 1)
        result = ModeResult("mixed", self.cfg.trials, tally.unique_counts(), tally.max_delta)
        result.notes.append(f"batch sizes {min(batch_sizes)}..{max(batch_sizes)}")
        return result

    def _prefix(self) -> ModeResult:
        lens = sorted(set(self.cfg.prefix_lens))
        base = self._random_ids(max(lens))
        tally = OutputTally()
        for t in range(self.cfg.trials):
            if t % 2 == 0:
                flush_cache(self.client)
            batch = [lens[t % len(lens)]] + [self.rng.choice(lens) for _ in range(self.rng.randrange(len(lens)))]
            self.rng.shuffle(batch)
            outs = self._generate([base[:n] for n in batch], [self._params()] * len(batch))
            for n, out in zip(batch, outs):
                tally.add(f"len {n}", self._one(out))
        counts = tally.unique_counts()
        unique = {f"len {n}": counts[f"len {n}"] for n in lens if f"len {n}" in counts}
        return ModeResult("prefix", self.cfg.trials, unique, tally.max_delta)

    def _radix(self) -> ModeResult:
        tally, cold_hits, warm_hits, colds = OutputTally(), 0, 0, 0
        for size in waves(self.cfg.trials):
            flush_cache(self.client)
            cold = self._one(self._generate([self.target], [self._params()])[0])
            warm = self._generate([self.target] * size, [self._params()] * size)
            for out in [cold] + warm:
                tally.add("target", self._one(out))  # vs the first cold run
            colds, cold_hits = colds + 1, cold_hits + (_cached(cold) > 0)
            warm_hits += sum(_cached(o) > 0 for o in warm)
        result = ModeResult("radix", self.cfg.trials, tally.unique_counts(), tally.max_delta)
        result.notes.append(f"{colds} cold runs ({cold_hits} with cache hits), {self.cfg.trials} warm runs "
                            f"({warm_hits} with cache hits)")
        if warm_hits == 0:
            result.failures.append("no warm run was served from the radix cache (is it disabled?)")
        return result

    def _p_vs_d(self) -> ModeResult:
        # from the prompt's last token: its entry is null (SGLang's first), the rest are the outputs'
        tally, delta, start = OutputTally(), 0.0, len(self.target) - 1
        reread = {**self._params(), "max_new_tokens": 1}  # same distribution; 0 new tokens aborts today
        for size in waves(self.cfg.trials):
            outs = [self._one(o) for o in self._generate([self.target] * size, [self._params()] * size)]
            again = self._generate([self.target + o["output_ids"] for o in outs], [reread] * size,
                                   logprob_start_len=start)
            for out, re in zip(outs, again):
                tally.add("target", out)
                delta = max(delta, max_abs_delta(logprob_values(out),
                                                 logprob_values(self._one(re), "input_token_logprobs")[1:]))
        result = ModeResult("p_vs_d", self.cfg.trials, tally.unique_counts(), max(delta, tally.max_delta))
        result.notes.append(f"decode vs prefill {delta:.3g}, across trials {tally.max_delta:.3g}")
        return result

    # ---- pieces --------------------------------------------------------------------------------
    def _generate(self, input_ids: list[list[int]], params: list[dict], logprob_start_len: int = -1) -> list[dict]:
        outs = self.client.generate(input_ids, params, return_logprob=True, logprob_start_len=logprob_start_len)
        if len(outs) != len(input_ids):
            raise HarnessError(f"sent {len(input_ids)} requests, got {len(outs)} outputs")
        return outs

    @staticmethod
    def _one(out: dict) -> dict:
        reason = out.get("meta_info", {}).get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise HarnessError(f"request {out['meta_info'].get('id')} aborted: {reason.get('message')}")
        return out

    def _params(self) -> dict:
        params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature,
                  "ignore_eos": True}
        if self.cfg.temperature > 0:
            params["sampling_seed"] = self.cfg.sampling_seed
        return params

    def _other_params(self) -> dict:
        rng = self.rng
        params = rng.choice([
            {"temperature": 0.0},
            {"temperature": 0.8, "top_p": 0.9, "sampling_seed": rng.randrange(1 << 30)},
            {"temperature": 1.2, "top_k": 20},
        ])
        return params | {"max_new_tokens": rng.randint(1, self.cfg.max_new_tokens), "ignore_eos": True}

    def _random_ids(self, n: int) -> list[int]:
        low = FIRST_TOKEN_ID if self.vocab > 2 * FIRST_TOKEN_ID else 0
        return [self.rng.randrange(low, self.vocab) for _ in range(n)]


def _cached(out: dict) -> int:
    return int(out.get("meta_info", {}).get("cached_tokens") or 0)


def modes_of(name: str) -> list[str]:
    return list(MODES) if name == "all" else [name]
