"""stop_regex search (engine/stop_regex.py): only where a new match can be, within a
time limit. Oracle: re.search over the whole text, as SGLang searches it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from engine.sampling_params import SamplingParams
from engine.scheduler import finish
from engine.stop_regex import LOOKBACK, new_match


def checkpoints(text: str, step: int) -> list[int]:
    """The text's lengths after each token, with tokens of `step` characters."""
    return sorted({min(end, len(text)) for end in range(step, len(text) + step, step)})


def first_stop(pattern: str, text: str, step: int) -> int:
    """The length at which new_match first fires as the text grows token by token."""
    checked = 0
    for end in checkpoints(text, step):
        if new_match(pattern, text[:end], checked):
            return end
        checked = end
    return -1


@pytest.mark.parametrize("pattern", [r"ab", r"\d+\.", r"(?<=x)y", r"^Answer", r"(?m)^Answer: \w", r"b\b", r"[0-9]{2,5}!"])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_windowed_search_stops_where_a_whole_text_search_first_matches(pattern, step):
    texts = ["zzzabzz", "the answer is 12345. done", "axy then xy", "Answer first", "no\nAnswer: yes",
             "ab b c", "xx 1234! yy", "Answer" + "q" * 50, "q" * 50 + "\nAnswer: z"]
    for text in texts:
        want = next((end for end in checkpoints(text, step) if re.search(pattern, text[:end])), -1)
        assert first_stop(pattern, text, step) == want, (pattern, text, step)


def test_unbounded_pattern_looks_back_lookback_characters():
    text = "Answer: " + "7" * (LOOKBACK - 20) + "."
    assert new_match(r"Answer: \d+\.", text, len(text) - 1)  # its start is within reach
    far = "Answer: " + "7" * (LOOKBACK + 50) + "."
    assert not new_match(r"Answer: \d+\.", far, len(far) - 1)  # past LOOKBACK: not searched (documented)


def test_catastrophic_pattern_aborts_its_request_instead_of_stalling_the_loop():
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=[r"(a|aa)+$"]), text="a" * 40 + "b",
                          stop_regex_checked=0)
    reason = finish._match_stop_regex(req)
    assert reason["type"] == "abort" and "(a|aa)+$" in reason["message"] and "simpler patterns" in reason["message"]


def test_a_requests_patterns_share_one_search_budget(monkeypatch):
    """All of a request's patterns search against one deadline a step; a search that starts past
    it ends the request, whatever its pattern."""
    import time

    from engine.stop_regex import StopRegexTooSlow

    deadlines = []
    monkeypatch.setattr(finish, "new_match", lambda p, t, c, deadline: deadlines.append(deadline) or False)
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=["x1y", "x2y", "x3y"]), text="abc",
                          stop_regex_checked=0)
    assert finish._match_stop_regex(req) is None
    assert len(deadlines) == 3 and len(set(deadlines)) == 1
    with pytest.raises(StopRegexTooSlow, match="fewer or simpler"):
        new_match("x1y", "abc", 0, deadline=time.perf_counter() - 1)


def test_stop_regex_patterns_are_bounded_in_number():
    from engine.sampling_params import MAX_STOP_REGEX

    SamplingParams.from_dict({"stop_regex": [f"x{i}y" for i in range(MAX_STOP_REGEX)]}).validate()
    with pytest.raises(ValueError, match=f"stop_regex must be at most {MAX_STOP_REGEX} patterns"):
        SamplingParams.from_dict({"stop_regex": [f"x{i}y" for i in range(MAX_STOP_REGEX + 1)]}).validate()


def test_stop_strings_are_bounded_in_number_and_length():
    """Each stop string is looked for at every step on the core loop: a request with 500,000 of
    them slowed every other request 32x."""
    from engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    SamplingParams.from_dict({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]}).validate()
    SamplingParams.from_dict({"stop": "x" * MAX_STOP_STRING_CHARS}).validate()
    with pytest.raises(ValueError, match=f"stop must be at most {MAX_STOP_STRINGS} strings, got 500000"):
        SamplingParams.from_dict({"stop": ["zq"] * 500_000}).validate()
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRING_CHARS} characters, got one of 513"):
        SamplingParams.from_dict({"stop": ["end", "x" * (MAX_STOP_STRING_CHARS + 1)]}).validate()


def test_patterns_that_match_nothing_or_everything_are_refused():
    for pattern in ["x*", "", "$", "(?:)"]:
        with pytest.raises(ValueError, match="matches the empty string"):
            SamplingParams.from_dict({"stop_regex": pattern}).validate()
    SamplingParams.from_dict({"stop_regex": ["x+", "^The"]}).validate()


def test_compiling_patterns_is_not_on_the_search_budget(monkeypatch):
    """A cold compile (milliseconds for a long alternation, in the core's own process) happens
    before the step's searches are timed: it is no slow search."""
    import time

    from engine import stop_regex

    real, seen = stop_regex._compiled, set()

    def slow_first_compile(pattern):
        if pattern not in seen:
            seen.add(pattern)
            time.sleep(0.015)  # three of these pass the 20 ms budget
        return real(pattern)

    monkeypatch.setattr(stop_regex, "_compiled", slow_first_compile)
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=["x1y", "x2y", "x3y"]), text="abc x9y",
                          stop_regex_checked=0)
    assert finish._match_stop_regex(req) is None


def test_an_empty_stop_string_is_refused():
    """'' is in every text: it would end each request at its first token (a completions client
    sent stop="" and got empty text back, with status 200)."""
    for stop in ["", ["</s>", ""]]:
        with pytest.raises(ValueError, match="stop has an empty string"):
            SamplingParams.from_dict({"stop": stop}).validate()
    SamplingParams.from_dict({"stop": ["</s>", " "]}).validate()


@pytest.mark.parametrize("depth", [460, 500, 5000])
def test_a_pattern_nested_too_deeply_to_compile_is_refused_naming_the_field(depth):
    """460 groups parse in re but not in the `regex` module the searches use (it crashed the
    core's step and aborted the other requests of its batch); 500 took re's parser past the
    recursion limit (an HTTP 500). Both are the request's ValueError (its 400) now."""
    pattern = "(" * depth + "a" + ")" * depth
    with pytest.raises(ValueError, match="stop_regex is nested too deeply"):
        SamplingParams.from_dict({"stop_regex": pattern}).validate()


def test_a_pattern_the_core_cannot_compile_aborts_only_its_request(monkeypatch):
    """A core on a deeper stack than validate's: compiling fails there too rarely to bet a
    batch on, so the request ends with an abort naming stop_regex."""
    from engine import stop_regex

    def too_deep(pattern):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(stop_regex, "_compiled", too_deep)
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=["x1y"]), text="abc", stop_regex_checked=0)
    reason = finish._match_stop_regex(req)
    assert reason["type"] == "abort" and "stop_regex could not be compiled" in reason["message"]


def test_a_pattern_only_the_regex_module_refuses_is_invalid():
    """`[[:foo:]]` passes re's parser; the regex module's error is no ValueError (it was a 500)."""
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="is not a valid regular expression"):
        SamplingParams.from_dict({"stop_regex": "[[:foo:]]"}).validate()


@pytest.mark.parametrize("pattern", ["a{10000000}", "a{1000000000}", "x{2000,}", "(?:a{200}){200}", "(?>a{3000})",
                                     "(?=b{5000})c"])
def test_counted_repeats_past_the_bounds_are_refused_before_compiling(pattern):
    """The regex module expands counted repeats: a{10000000} took 3.8 s and 2.7 GB to compile."""
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match="counted repeats go up to 1000"):
        SamplingParams.from_dict({"stop_regex": pattern}).validate()
    assert time.perf_counter() - start < 0.5
    SamplingParams.from_dict({"stop_regex": ["a{1000}", "(?:a{100}){100}", "x+y*"]}).validate()


def test_a_search_that_waited_for_the_cpu_is_no_slow_search(monkeypatch):
    """A loaded host may preempt the core past the budget mid-search: the wall time is not the
    pattern's, so the step searches once more instead of aborting a request with a simple pattern."""
    import time

    from engine.stop_regex import StopRegexTooSlow

    calls = []

    def preempted_once(pattern, text, checked, deadline):
        calls.append(pattern)
        if len(calls) == 1:
            time.sleep(0.05)  # waiting, not computing
            raise StopRegexTooSlow("too slow")
        return pattern == "x9y"

    monkeypatch.setattr(finish, "new_match", preempted_once)
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=["x1y", "x9y"]), text="abc x9y",
                          stop_regex_checked=0)
    assert finish._match_stop_regex(req) == {"type": "stop", "matched": "x9y"}
    assert calls == ["x1y", "x1y", "x9y"]


def test_a_search_that_used_its_cpu_budget_aborts_at_once(monkeypatch):
    """A pattern that burns the budget computing is too slow: no second try."""
    import time

    from engine.stop_regex import SEARCH_TIMEOUT_S, StopRegexTooSlow

    calls = []

    def burns_cpu(pattern, text, checked, deadline):
        calls.append(pattern)
        start = time.thread_time()
        while time.thread_time() - start < SEARCH_TIMEOUT_S:
            pass
        raise StopRegexTooSlow("stop_regex searches took over 20 ms")

    monkeypatch.setattr(finish, "new_match", burns_cpu)
    req = SimpleNamespace(sampling_params=SimpleNamespace(stop_regex=["(a|aa)+$"]), text="aaaa", stop_regex_checked=0)
    assert finish._match_stop_regex(req)["type"] == "abort"
    assert calls == ["(a|aa)+$"]
