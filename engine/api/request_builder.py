"""RequestBuilder: turns a GenerateRequest into validated, tokenized ReqInput messages.

Every check that can fail on user input happens here, in the caller's thread, so a bad request
raises a ValueError naming the problem and never reaches the core.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Optional

from engine.api.generate_request import GenerateRequest
from engine.api.prompt_ids import PromptIds
from engine.api.prompt_size import PromptSize
from engine.api.request_ids import fresh_rid
from engine.config import LOGPROB_DISTRIBUTIONS, ServerArgs
from engine.core.messages import ReqInput
from engine.grammar.compile_pool import GrammarUnavailable  # noqa: F401  (the server's 503: it imports engine.api only)
from engine.grammar.compiler import grammar_spec
from engine.grammar.grammar_check import GrammarCheck, make_grammar_check
from engine.api.lora_names import LoRANames
from engine.grammar.grammar_limits import GrammarLimits
from engine.sampling.seeds import derive_seed
from engine.sampling_params import GRAMMAR_FIELDS, SamplingParams
from engine.tokenizer import check_text

# token_ids_logprob's values a request may ask for: ids x (prompt positions + new tokens). Each is a
# float gathered on the device and a Python float in the reply (~16M: ~64 MB on the device, ~0.5 GB
# of reply); past it one request's prompt chunk could take the whole batch's memory.
MAX_ID_LOGPROBS = 1 << 24


class RequestBuilder:
    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int, server_args: ServerArgs,
                 max_total_num_tokens: Optional[int] = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.max_total_num_tokens = max_total_num_tokens  # the KV pool: None = unknown, unchecked
        self.prompt_size = PromptSize(tokenizer, context_len, server_args.max_prompt_bytes)
        self.prompts = PromptIds(tokenizer, vocab_size, context_len, self.prompt_size, server_args.max_batch_requests)
        self.default_distribution = server_args.logprob_distribution
        self.max_n = server_args.max_n
        self.max_batch_requests = server_args.max_batch_requests
        self.routes_kept = server_args.enable_return_routed_experts
        self.lora = LoRANames(server_args.enable_lora)  # the Engine keeps it up to date
        # Unseeded requests draw their seed from here, so a whole run replays from --random-seed.
        self._seed_rng = random.Random(server_args.random_seed)
        self.grammars: GrammarCheck = make_grammar_check(tokenizer, vocab_size, GrammarLimits.of(server_args),
                                                         server_args.grammar_compile_workers)

    def build(self, request: GenerateRequest) -> tuple[list[ReqInput], bool]:
        """Returns one ReqInput per (prompt, sample) pair, prompt-major, and whether the caller
        passed a single prompt (so the result is a dict rather than a list). The logprob options
        are decided here once: without return_logprob a request asks for no logprob of any kind."""
        prompts, single = self.prompts.token_lists(request.prompt, request.input_ids)
        n = len(prompts)
        params = self._sampling_params(request.sampling_params, n)
        defaulted = _length_left_out(request.sampling_params, n)
        self._check_counts(params)
        rids = self._rids(request.rid, n, single)
        want = _per_prompt("return_logprob", request.return_logprob, n, _check_return_logprob)
        starts = _per_prompt("logprob_start_len", request.logprob_start_len, n, lambda v: v)
        tops = _per_prompt("top_logprobs_num", request.top_logprobs_num, n, self._checked_top_logprobs_num)
        distribution = self._distribution(request.logprob_distribution)
        id_lists = self._token_ids_logprob(request.token_ids_logprob, n)
        routes = _per_prompt("return_routed_experts", request.return_routed_experts, n, self._checked_routes)
        route_starts = _per_prompt("routed_experts_start_len", request.routed_experts_start_len, n, lambda v: v)
        adapters = _per_prompt("lora_path", request.lora_path, n, self.lora.check)
        salts = _per_prompt("extra_key", request.extra_key, n, _check_extra_key)
        out: list[ReqInput] = []
        for ids, p, base_rid, wanted, lp, start, top, route, route_start, adapter, salt, default_length in zip(
                prompts, params, rids, id_lists, want, starts, tops, routes, route_starts, adapters, salts, defaulted):
            if lp:  # read only with logprobs (SGLang ignores it otherwise, as the ReqInput below does)
                self._check_logprob_start(start, len(ids))
            _check_route_start(route_start, len(ids))
            p = self._bounded(p, len(ids), default_length)
            self._check_fits(len(ids), p.max_new_tokens)
            if lp and wanted:
                _check_id_logprob_count(len(wanted), (len(ids) - start if start >= 0 else 0) + p.max_new_tokens)
            base_seed = p.sampling_seed if p.sampling_seed is not None else self._seed_rng.getrandbits(63)
            for i in range(p.n):
                out.append(ReqInput(
                    rid=base_rid if p.n == 1 else f"{base_rid}-{i}", input_ids=ids, sampling_params=p,
                    seed=base_seed if p.n == 1 else derive_seed(base_seed, i), return_logprob=lp,
                    logprob_start_len=start if lp else -1, top_logprobs_num=top if lp else 0,
                    token_ids_logprob=wanted if lp else None, logprob_distribution=distribution,
                    stream=request.stream, return_routed_experts=route, routed_experts_start_len=route_start,
                    lora_path=adapter, return_prompt_token_ids=bool(request.return_prompt_token_ids),
                    extra_key=salt,
                ))
        self._check_unique_rids(out)
        return out, single and params[0].n == 1

    def _distribution(self, asked: Optional[str]) -> str:
        distribution = self.default_distribution if asked is None else asked
        if not isinstance(distribution, str) or distribution not in LOGPROB_DISTRIBUTIONS:
            raise ValueError(f"logprob_distribution must be one of {LOGPROB_DISTRIBUTIONS}; got {distribution!r}")
        return distribution

    # ---- pieces --------------------------------------------------------------------------------
    def _token_ids_logprob(self, raw: Any, n_prompts: int) -> list[Optional[list[int]]]:
        """SGLang's token_ids_logprob: one list of ids for every prompt, or one list per prompt
        (None or [] for none); each prompt's list serves all of its n samples."""
        if raw is None:
            return [None] * n_prompts
        what = "token_ids_logprob must be a list of token ids, or one such list per prompt"
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"{what}; got {type(raw).__name__}")
        if not raw:
            return [None] * n_prompts
        if all(isinstance(x, (list, tuple)) or x is None for x in raw):
            if len(raw) != n_prompts:
                raise ValueError(f"token_ids_logprob has {len(raw)} lists for {n_prompts} prompts")
            return [self._checked_token_ids(x, what) if x else None for x in raw]
        shared = self._checked_token_ids(raw, what)
        return [shared] * n_prompts

    def _checked_token_ids(self, ids: Any, what: str) -> list[int]:
        if len(ids) > 2 * self.vocab_size:  # each id is a value per position of the reply: millions stalled it
            raise ValueError(f"token_ids_logprob has {len(ids)} ids, more than twice the vocabulary's {self.vocab_size}")
        ids = list(ids)
        kinds = {type(t) for t in ids}
        if not kinds <= {int}:  # bool is its own type: refused, as are floats and strings
            bad = next(t for t in ids if type(t) is not int)
            raise ValueError(f"{what}; got the entry {bad!r} ({type(bad).__name__})")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token_ids_logprob has token id {bad} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _bounded(self, params: SamplingParams, prompt_len: int, defaulted: bool = False) -> SamplingParams:
        """max_new_tokens None (SGLang's null: no limit of its own) -> the room the prompt leaves
        in the context length and the KV pool, which the request then may fill. Left out
        (`defaulted`: the default 128) it is capped at that room, as SGLang's scheduler caps it
        without a word; only a max_new_tokens the caller set is refused when it does not fit."""
        room = max(min(self.context_len, self.max_total_num_tokens or self.context_len) - prompt_len, 0)
        if params.max_new_tokens is not None and not (defaulted and params.max_new_tokens > room):
            return params
        if params.min_new_tokens > room:
            raise ValueError(f"min_new_tokens {params.min_new_tokens} does not fit: the {prompt_len}-token prompt "
                             f"leaves room for {room} new tokens")
        return dataclasses.replace(params, max_new_tokens=room)

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """A request the engine could never finish is refused now rather than queued forever:
        prompt + max_new_tokens must fit the context length (SGLang since 0.5.23 refuses the same,
        with these words; exactly the context length fits) and the KV pool, which has to hold all
        of them at once (the scheduler admits on that forecast)."""
        total = prompt_len + max_new_tokens
        asked = f"{prompt_len} prompt tokens + max_new_tokens {max_new_tokens} = {total} tokens"
        if total > self.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_len} tokens. You requested a total of {total} tokens: {prompt_len} "
                             f"tokens from the input messages and {max_new_tokens} tokens for the completion. "
                             f"Please reduce the number of tokens in the input messages or the completion to fit "
                             f"within the limit. (max_new_tokens at most {self.context_len - prompt_len} for this "
                             f"prompt)")
        pool = self.max_total_num_tokens
        if pool is not None and total > pool:
            room = f"lower max_new_tokens to at most {pool - prompt_len}, " if prompt_len < pool else ""
            raise ValueError(f"{asked} exceed the KV cache pool of {pool} tokens (max_total_num_tokens); "
                             f"{room}shorten the prompt or start the engine with a larger --max-total-tokens")

    def _sampling_params(self, raw: Any, n_prompts: int) -> list[SamplingParams]:
        if not isinstance(raw, (list, tuple)):  # one dict for every prompt: read and checked once
            return [self._checked_params(raw)] * n_prompts
        if len(raw) != n_prompts:
            raise ValueError(f"sampling_params has {len(raw)} entries for {n_prompts} prompts")
        return [self._checked_params(item) for item in raw]

    def _checked_params(self, item: Any) -> SamplingParams:
        params = item if isinstance(item, SamplingParams) else SamplingParams.from_dict(item)
        params.validate(self.vocab_size)
        if params.watches_text and self.tokenizer is None:  # they would never match
            raise ValueError("stop and stop_regex match the output's text, and this engine was started with "
                             "skip_tokenizer_init (no tokenizer to build it): use stop_token_ids")
        _check_texts(params)
        self._check_grammar(params)
        return params

    def _check_grammar(self, params: SamplingParams) -> None:
        """Size-check and compile the grammar (in a worker, under its time limit) so a bad or slow
        one is a ValueError here, not in the core; the core compiles it again from the spec
        (compiled grammars do not pickle)."""
        spec = grammar_spec(params)
        if spec is not None:
            self.grammars.check(*spec)

    def _checked_top_logprobs_num(self, k: Any) -> int:
        if not _is_int(k) or not 0 <= k <= self.vocab_size:  # bool is no count
            raise ValueError(f"top_logprobs_num must be an int in [0, {self.vocab_size}], got {k!r}")
        return k

    @staticmethod
    def _rids(rid: Any, n: int, single: bool) -> list[str]:
        """The requests' ids; none given (or "", which no abort can name: /abort_request takes an
        empty rid for none) -> fresh ones, so clients sending "" never collide."""
        if rid is None or rid == "":
            return [fresh_rid() for _ in range(n)]
        rids = [rid] if isinstance(rid, str) else list(rid) if isinstance(rid, (list, tuple)) else None
        if rids is None or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid must be a string or a list of strings (one per prompt), got {rid!r}")
        for r in rids:  # every reply carries it: text that encodes
            check_text(r, "rid")
        if isinstance(rid, str) and not single:  # SGLang: one string for a batch names its items rid_i
            return [f"{rid}_{i}" for i in range(n)]
        if len(rids) != n:
            raise ValueError(f"rid has {len(rids)} entries for {n} prompts")
        return [r or fresh_rid() for r in rids]

    def _check_counts(self, params: list[SamplingParams]) -> None:
        too_many = [p.n for p in params if p.n > self.max_n]
        if too_many:
            raise ValueError(f"n={too_many[0]} is over the limit of {self.max_n} samples per prompt "
                             "(--max-n)")
        total = sum(p.n for p in params)
        if total > self.max_batch_requests:
            raise ValueError(f"this call asks for {total} requests (prompts x n); the limit is "
                             f"{self.max_batch_requests} (--max-batch-requests): split it")

    @staticmethod
    def _check_unique_rids(reqs: list[ReqInput]) -> None:
        """Checked before anything is submitted, so a refused batch leaves nothing running."""
        seen: set[str] = set()
        for r in reqs:
            if r.rid in seen:
                raise ValueError(f"rid {r.rid!r} appears twice in this batch; rids must be unique")
            seen.add(r.rid)

    def _checked_routes(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {type(value).__name__}")
        if value and not self.routes_kept:  # SGLang refuses it likewise
            raise ValueError("return_routed_experts needs the server started with --enable-return-routed-experts "
                             "(and a mixture-of-experts model)")
        return value

    @staticmethod
    def _check_logprob_start(start: int, prompt_len: int) -> None:
        if not _is_int(start) or not -1 <= start < prompt_len:
            raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or in [0, {prompt_len}), got {start!r}")


def _length_left_out(raw: Any, n_prompts: int) -> list[bool]:
    """Per prompt: whether its sampling params leave max_new_tokens out (the default applies),
    which SGLang caps at the context where a value the caller set is checked against it. An
    explicit null is set (no limit of its own); a SamplingParams object counts as set."""
    items = raw if isinstance(raw, (list, tuple)) else [raw] * n_prompts
    return [item is None or (isinstance(item, dict) and "max_new_tokens" not in item) for item in items]


def _check_id_logprob_count(ids: int, positions: int) -> None:
    if ids * positions > MAX_ID_LOGPROBS:
        raise ValueError(f"token_ids_logprob asks for {ids} ids at {positions} positions (prompt logprobs + "
                         f"max_new_tokens) = {ids * positions:,} values; the limit is {MAX_ID_LOGPROBS:,} a request: "
                         "ask for fewer ids, a later logprob_start_len or fewer new tokens")


def _check_route_start(start: Any, prompt_len: int) -> None:
    if not _is_int(start) or not 0 <= start <= prompt_len:  # SGLang's range: up to the whole prompt
        raise ValueError(f"routed_experts_start_len must be in [0, {prompt_len}] (the prompt's tokens), got {start!r}")


def _check_return_logprob(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"return_logprob must be a bool, got {type(value).__name__}")
    return value


def _per_prompt(name: str, value: Any, n_prompts: int, check: Any) -> list:
    """One value for every prompt, or a list of one per prompt (SGLang's batch form); each checked."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_prompts:
            raise ValueError(f"{name} has {len(value)} values for {n_prompts} prompts (give one, or one per prompt)")
        return [check(v) for v in value]
    return [check(value)] * n_prompts


def _check_extra_key(key: Any) -> Optional[str]:
    """SGLang's extra_key: a string naming the prompt's cache namespace; None or "" for none."""
    if key is not None and not isinstance(key, str):
        raise ValueError(f"extra_key must be a string (a cache salt), one per prompt, or null; got {type(key).__name__}")
    check_text(key or "", "extra_key")
    return key or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_texts(params: SamplingParams) -> None:
    """Stop strings, stop regexes and grammars are text the core matches and compiles: a lone
    surrogate is refused here, naming its field (later it fails without one)."""
    for name in ("stop", "stop_regex", *GRAMMAR_FIELDS):
        value = getattr(params, name)
        for text in [value] if isinstance(value, str) else value or ():
            check_text(text, name)
