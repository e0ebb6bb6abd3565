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
import time
from typing import Optional

import regex

try:
    from re import _parser as _sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]

LOOKBACK = 2048  # characters searched before the new text, for a pattern with no width bound
SEARCH_TIMEOUT_S = 0.02


class StopRegexTooSlow(Exception):
    pass


def compile_patterns(patterns: list[str]) -> None:
    """Compile (and cache) a request's patterns before its searches are timed: a cold compile of
    a long alternation takes milliseconds, and is no slow search."""
    for pattern in patterns:
        _compiled(pattern)


def compile_pattern(pattern: str) -> regex.Pattern:
    """The pattern as the searches use it (cached); raises what compiling raises (re.error,
    regex.error, RecursionError for deep nesting): SamplingParams.validate refuses those."""
    return _compiled(pattern)[0]


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


@functools.lru_cache(maxsize=4096)  # 64 patterns a request (MAX_STOP_REGEX) x many requests
def _compiled(pattern: str) -> tuple[regex.Pattern, int | None]:
    """The pattern compiled for the `regex` module (which takes re's syntax) and its maximum
    width in characters, None when unbounded."""
    widest = _sre_parse.parse(pattern).getwidth()[1]
    return regex.compile(pattern), (None if widest >= _sre_parse.MAXREPEAT else int(widest))
