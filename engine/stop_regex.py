"""stop_regex matching: SGLang's sampling param, searched only where a new match can be, and
with a time limit, because it runs on the core loop that serves every request.

A match must end in the text the newest token added (an older one would have stopped the run
already), so a pattern of bounded width W is searched from W characters before that text; one
without a bound (`\\d+`, `.*`) from LOOKBACK characters before it (SGLang searches the whole
output: a stop pattern that spans more than 2,048 characters is not one a client sends). The
`regex` module's timeout turns catastrophic backtracking into a clear abort of that request
instead of a stalled engine.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Optional

import regex

try:
    from re import _parser as _sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]

LOOKBACK = 2048  # characters searched before the new text, for a pattern with no width bound
SEARCH_TIMEOUT_S = 0.02
# The `regex` module expands a counted repeat as it compiles: a{10000000} took 3.8 s and 2.7 GB.
MAX_REPEAT_COUNT = 1000  # one counted repeat's bound
MAX_REPEAT_PRODUCT = 10_000  # counted repeats nested in each other, multiplied
_REPEATS = {getattr(_sre_parse, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
            if hasattr(_sre_parse, name)}


class StopRegexTooSlow(Exception):
    pass


INVALID = (re.error, regex.error)  # what compiling a malformed pattern raises (regex.error is no ValueError)


def compile_patterns(patterns: list[str]) -> None:
    """Compile (and cache) a request's patterns before its searches are timed: a cold compile of
    a long alternation takes milliseconds, and is no slow search."""
    for pattern in patterns:
        _compiled(pattern)


def compile_pattern(pattern: str) -> regex.Pattern:
    """The pattern as the searches use it (cached); raises what compiling raises (re.error,
    regex.error, RecursionError for deep nesting, ValueError for repeats over the bounds):
    SamplingParams.validate refuses those."""
    return _compiled(pattern)[0]


def _check_repeats(parsed: "_sre_parse.SubPattern") -> None:
    """A ValueError for a counted repeat over MAX_REPEAT_COUNT, or nested ones whose counts
    multiply past MAX_REPEAT_PRODUCT (unbounded ones, * and +, cost nothing to compile). Walked
    without recursion."""
    stack = [(parsed, 1)]
    while stack:
        items, outer = stack.pop()
        for op, av in items:
            if op in _REPEATS:
                low, high, sub = av
                count = low if high == _sre_parse.MAXREPEAT else high
                if count > MAX_REPEAT_COUNT or outer * max(count, 1) > MAX_REPEAT_PRODUCT:
                    raise ValueError(f"stop_regex repeats {count} times{' inside other repeats' if outer > 1 else ''}; "
                                     f"counted repeats go up to {MAX_REPEAT_COUNT} (nested: {MAX_REPEAT_PRODUCT} "
                                     f"in all)")
                stack.append((sub, outer * max(count, 1)))
            else:  # groups, branches, lookarounds, conditionals: their sub-patterns, at any place in av
                stack.extend((x, outer) for x in _sub_patterns(av))


def new_match(pattern: str, text: str, checked: int, deadline: Optional[float] = None) -> bool:
    """Whether `pattern` matches `text` somewhere a match could not have been before the text
    grew past `checked` characters; StopRegexTooSlow past SEARCH_TIMEOUT_S, or past `deadline`
    (time.perf_counter's): a request's patterns share one budget per step."""
    compiled, width = _compiled(pattern)
    start = max(0, checked - (width if width is not None else LOOKBACK))
    timeout = SEARCH_TIMEOUT_S if deadline is None else deadline - time.perf_counter()
    try:
        if timeout <= 0:
            raise TimeoutError
        return compiled.search(text, start, timeout=timeout) is not None
    except TimeoutError:
        raise StopRegexTooSlow(f"stop_regex searches took over {SEARCH_TIMEOUT_S * 1e3:.0f} ms on this output "
                               f"(at {pattern!r}); use fewer or simpler patterns") from None


def _sub_patterns(av: object) -> list:
    if isinstance(av, _sre_parse.SubPattern):
        return [av]
    if isinstance(av, (list, tuple)):
        return [x for entry in av for x in _sub_patterns(entry)] if any(
            isinstance(e, (list, tuple, _sre_parse.SubPattern)) for e in av) else []
    return []


@functools.lru_cache(maxsize=4096)  # 64 patterns a request (MAX_STOP_REGEX) x many requests
def _compiled(pattern: str) -> tuple[regex.Pattern, int | None]:
    """The pattern compiled for the `regex` module (which takes re's syntax) and its maximum
    width in characters, None when unbounded."""
    parsed = _sre_parse.parse(pattern)
    _check_repeats(parsed)
    widest = parsed.getwidth()[1]
    return regex.compile(pattern), (None if widest >= _sre_parse.MAXREPEAT else int(widest))
