"""SamplingParams: one request's sampling knobs, with SGLang's field names and defaults.

`from_dict` rejects unknown keys and wrong types (so a typo never silently falls back to a
default); `validate` checks ranges once the vocab size is known. Constructing the dataclass
directly runs the same type checks.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

FLOAT32_MAX = 3.4028234663852886e38  # a temperature past it is float32's inf
MIN_REPETITION_PENALTY = 1e-6
GREEDY_TEMPERATURE = 1e-6  # SGLang: temperature below this means greedy (top_k=1)

_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
)
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # compiled by engine/grammar
_OPTIONAL_STR_FIELDS = GRAMMAR_FIELDS
# a negative id parses, so its error names the range; past 4000 digits int() refuses (Python's limit)
_TOKEN_ID = re.compile(r"-?[0-9]{1,4000}")
# SGLang takes any bias (clients ban a token with -1e4, say); bounded only so that logits + bias
# stays finite in float32. OpenAI's own API stops at +-100, which forces or bans a token already.
LOGIT_BIAS_RANGE = 1e30
# stop_regex patterns are searched on the core loop at every step of the request: a bound on their
# number (SGLang has none; 20,000 patterns slowed every request of the engine 100x)
MAX_STOP_REGEX = 64
# stop strings too: each is looked for in the text's tail at every step on the core loop (500,000 of
# them in one request slowed every other request of the engine 32x); the tail looked at is as long
# as the longest string
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 512
MAX_CUSTOM_PARAMS_DEPTH = 64  # custom_params is carried to the core: deeper JSON could not be pickled there


def carries_grammar(raw_params: Any) -> bool:
    """Whether raw sampling params (a dict, or a list of them, as a client sent them) set a grammar."""
    items = raw_params if isinstance(raw_params, (list, tuple)) else [raw_params]
    return any(isinstance(item, dict) and any(item.get(kind) is not None for kind in GRAMMAR_FIELDS)
               for item in items)


@dataclass
class SamplingParams:
    # None: as many as the context length (and the KV pool) leave room for, SGLang's null; the
    # RequestBuilder turns it into that number per prompt, so the core always sees an int
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocab
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None  # normalised to list[str] | None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    stop_regex: Optional[Union[str, list[str]]] = None  # normalised to list[str] | None (engine/scheduler/finish.py)
    logit_bias: Optional[dict] = None  # {str(token id): bias added to the logit}, normalised from int keys
    custom_params: Optional[dict] = None  # carried; read: return_top_p_token_ids (slime's top-p replay)
    stream_interval: Optional[int] = None

    def __post_init__(self) -> None:
        self._check_types()
        self.stop, self.stop_regex = _str_list(self.stop), _str_list(self.stop_regex)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalised_logit_bias(self.logit_bias)

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict (or a list of dicts, one per prompt), "
                             f"got {type(d).__name__}")
        d = dict(d or {})
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown sampling_params field(s) {unknown}; allowed fields: {', '.join(allowed)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def watches_text(self) -> bool:
        """Stop strings or stop regexes: the core must detokenize as it generates."""
        return bool(self.stop or self.stop_regex)

    @property
    def return_top_p_token_ids(self) -> bool:
        """slime's custom_params flag: each output token's kept ids come back (engine/sampling/nucleus.py)."""
        return isinstance(self.custom_params, dict) and bool(self.custom_params.get("return_top_p_token_ids"))

    @property
    def is_greedy(self) -> bool:
        # SGLang folds temperature ~0 into top_k=1, and treats top_k=1 as greedy
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    # ---- validation -------------------------------------------------------------------

    def validate(self, vocab_size: Optional[int] = None) -> SamplingParams:
        """Raise ValueError naming the field and its allowed range; return self."""
        _check(len(self.stop_regex or ()) <= MAX_STOP_REGEX, "stop_regex", f"at most {MAX_STOP_REGEX} patterns",
               f"{len(self.stop_regex or ())} patterns")
        for pattern in self.stop_regex or ():
            _check_stop_regex(pattern)
        _check(len(self.stop or ()) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings",
               f"{len(self.stop or ())} strings")
        longest = max(map(len, self.stop or ("",)))
        _check(longest <= MAX_STOP_STRING_CHARS, "stop", f"strings of at most {MAX_STOP_STRING_CHARS} characters",
               f"one of {longest}")
        if "" in (self.stop or ()):  # every text contains it: the request would end at its first token
            raise ValueError("stop has an empty string, which would stop at the first token; leave it out")
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"set at most one of json_schema, regex, ebnf, structural_tag; got {grammars}")
        _check(0 <= self.temperature <= FLOAT32_MAX, "temperature", ">= 0 (and a float32)", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 (whole vocab) or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        if self.max_new_tokens is None:
            _check(self.min_new_tokens >= 0, "min_new_tokens", ">= 0", self.min_new_tokens)
        else:
            _check(self.max_new_tokens >= 0, "max_new_tokens", ">= 0", self.max_new_tokens)
            _check(
                0 <= self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens", f"in [0, max_new_tokens={self.max_new_tokens}]", self.min_new_tokens,
            )
        # SGLang's [0, 2] from 1e-6: a seen token's logit is divided by it, and a smaller penalty
        # (1e-46 is float32's 0) turned logits into inf or NaN and the request into a run of token 0
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2, "repetition_penalty",
               f"in [{MIN_REPETITION_PENALTY:g}, 2]", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, "in [-2, 2]", getattr(self, name))
        _check(self.n >= 1, "n", ">= 1", self.n)
        if self.stream_interval is not None:
            _check(self.stream_interval >= 1, "stream_interval", ">= 1", self.stream_interval)
        if self.sampling_seed is not None:
            seed = self.sampling_seed
            _check(-(1 << 63) <= seed < (1 << 64), "sampling_seed", "a 64-bit integer", seed)
        self._validate_stop_token_ids(vocab_size)
        self._validate_logit_bias(vocab_size)
        return self

    def _validate_stop_token_ids(self, vocab_size: Optional[int]) -> None:
        hi = f"{vocab_size})" if vocab_size is not None else "inf)"
        for tok in self.stop_token_ids or ():
            ok = tok >= 0 and (vocab_size is None or tok < vocab_size)
            _check(ok, "stop_token_ids", f"in [0, {hi}", tok)

    def _validate_logit_bias(self, vocab_size: Optional[int]) -> None:
        hi = vocab_size - 1 if vocab_size is not None else "inf"
        for key in self.logit_bias or ():
            tok = int(key)
            _check(tok >= 0 and (vocab_size is None or tok < vocab_size), "logit_bias",
                   f"keyed by token ids in [0, {hi}]", key)

    def logit_bias_ids(self) -> tuple[list[int], list[float]]:
        """(token ids, biases) of logit_bias, for the sampler."""
        items = (self.logit_bias or {}).items()
        return [int(k) for k, _ in items], [v for _, v in items]

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            if name != "max_new_tokens" or self.max_new_tokens is not None:
                _require_int(name, getattr(self, name))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {type(value).__name__}")
            try:
                value = float(value)
            except OverflowError:  # an int past float's range
                raise ValueError(f"{name} must be a finite number, got {value}") from None
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            setattr(self, name, value)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in _OPTIONAL_STR_FIELDS:
            _require_optional(name, getattr(self, name), str, "a string")
        for name in ("sampling_seed", "stream_interval"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in ("logit_bias", "custom_params"):
            _require_optional(name, getattr(self, name), dict, "a dict")
        if nests_deeper(self.custom_params, MAX_CUSTOM_PARAMS_DEPTH):
            raise ValueError(f"custom_params must be nested at most {MAX_CUSTOM_PARAMS_DEPTH} levels deep; "
                             f"it nests deeper")
        if self.return_top_p_token_ids and not (self.is_greedy or self.top_p < 1 or self.top_k != -1 or self.min_p > 0):
            raise ValueError("custom_params.return_top_p_token_ids returns each token's kept set under top_p, top_k "
                             "or min_p, and this request sets none of them (every id would be kept): set top_p < 1, "
                             "or leave the flag out")
        self._check_list_types()

    def _check_list_types(self) -> None:
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
                    raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple, set)) or not all(_is_int(t) for t in ids):
                raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")


def _str_list(value: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
    """A string or a sequence of strings -> a list of them; None stays None."""
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether objects and arrays in `value` nest more than `limit` levels deep (client JSON may nest
    ~1000 levels; what walks it recursively later, a chat template or pickling, fails far sooner).
    Level by level, each container once (a self-referencing dict ends too), stopping past `limit`."""
    level, seen, depth = [value], set(), 0
    while True:
        containers = [v for v in level if isinstance(v, (dict, list, tuple)) and id(v) not in seen]
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        seen.update(id(v) for v in containers)
        level = [child for v in containers for child in (v.values() if isinstance(v, dict) else v)]


def _check_stop_regex(pattern: str) -> None:
    """A regular expression that does not match the empty string (one that does would stop every
    request at its first token), compiled here as engine/stop_regex.py compiles it for
    its searches (the `regex` module, whose parser recurses deeper than re's), so a pattern the
    core could not compile is this request's 400, never a failed step of everyone's batch."""
    from engine.stop_regex import INVALID, compile_pattern

    try:
        compiled = compile_pattern(pattern)  # ValueError: repeats over the bounds, named there
    except RecursionError:
        raise ValueError(f"stop_regex is nested too deeply to compile ({len(pattern)} characters); "
                         f"use a flatter pattern") from None
    except INVALID as exc:
        raise ValueError(f"stop_regex {pattern[:200]!r} is not a valid regular expression: {exc}") from None
    if compiled.search("") is not None:
        raise ValueError(f"stop_regex {pattern!r} matches the empty string, so it would stop at the first token")


def _normalised_logit_bias(bias: dict) -> dict[str, float]:
    """SGLang's logit_bias {token id (a decimal string; an int in-process): bias} -> {str(id): float}.
    Bias values are checked here (they need no vocab); ids' range in validate."""
    out: dict[str, float] = {}
    for key, value in bias.items():
        if _is_int(key):
            key = str(key)
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key.strip()):  # no "1.5", "", "abc"
            raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise ValueError(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
        _check(-LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE, f"logit_bias[{key!r}]",
               f"in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]", value)
        out[str(int(key))] = float(value)
    return out


def _finite(value: float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")


def _require_optional(name: str, value: Any, kind: type, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{name} must be {what} or null, got {type(value).__name__}")


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value}")
