"""Stop checks: length, then (after min_new_tokens) stop strings, stop regexes, then EOS and stop
tokens. (SGLang checks the tokens before the strings: where a stop token also completes a stop
string, it reports the token and this the string.)"""

from __future__ import annotations

import time
from typing import Optional

from engine.finish_reasons import abort_reason
from engine.scheduler.request import Req
from engine.stop_regex import INVALID, SEARCH_TIMEOUT_S, StopRegexTooSlow, compile_patterns, new_match


def check_finished(req: Req, eos_token_ids: tuple[int, ...], context_len: int) -> Optional[dict]:
    params = req.sampling_params
    n_out = len(req.output_ids)
    if n_out >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if req.seq_len >= context_len:
        return {"type": "length", "length": n_out}
    if n_out < params.min_new_tokens:
        return None
    matched = _match_stop_string(req)
    if matched is not None:
        return {"type": "stop", "matched": matched}
    regex_reason = _match_stop_regex(req)
    if regex_reason is not None:
        return regex_reason
    token = req.output_ids[-1]
    if token in (params.stop_token_ids or ()) or (not params.ignore_eos and token in eos_token_ids):
        return {"type": "stop", "matched": token}
    return None


def _match_stop_string(req: Req) -> Optional[str]:
    """Finds a stop string in the tail of the text; trims the text there unless no_stop_trim."""
    stops = req.sampling_params.stop
    if not stops or not req.text:
        return None
    best = first_stop_in_tail(req.text, stops)
    if best is None:
        return None
    req.stop_text_len = best[0]
    if not req.sampling_params.no_stop_trim:
        req.text = req.text[: best[0]]
    return best[1]


def first_stop_in_tail(text: str, stops: list[str]) -> Optional[tuple[int, str]]:
    """(where, which) of the first stop string in the tail the stop check searches: as long as the
    longest string, and a bit more (new text of one token is short)."""
    tail_start = max(len(text) - (max(len(s) for s in stops) + 16), 0)
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        idx = text.find(stop, tail_start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def stop_prefix_len(text: str, stops: Optional[list[str]], scan: Optional[list[int]] = None) -> int:
    """The length of the text's longest tail that begins a stop string without completing it: a
    stream holds it back until the text completes the string (and is trimmed before it) or leaves
    it, so no client ever receives text the final answer takes back (OpenAI's and SGLang's rule).
    `scan` (one int a stop string, kept by the caller while the text only grows): where each
    string's search starts. A position whose tail is not a start of the string never is again once
    the text grows, so each is ruled out once: hostile stop strings (128 of 512 characters over a
    run of one letter) cost what the stop check costs, not ~40x that at every streamed token."""
    held = 0
    for k, stop in enumerate(stops or ()):
        start = max(len(text) - len(stop) + 1, scan[k] if scan is not None else 0, 0)
        start = text.find(stop[0], start)
        while start >= 0 and not stop.startswith(text[start:]):
            start = text.find(stop[0], start + 1)
        if scan is not None:
            scan[k] = start if start >= 0 else len(text)
        if start >= 0:
            held = max(held, len(text) - start)  # this string's longest tail: its first fitting start
    return held


def _match_stop_regex(req: Req) -> Optional[dict]:
    """The finish reason of the first stop_regex the new text completes (the text is kept
    whole, as SGLang keeps it: its trim looks for the pattern itself in the text), or an abort
    when a pattern is too slow to search (engine/stop_regex.py)."""
    patterns = req.sampling_params.stop_regex
    if not patterns or not req.text:
        return None
    checked, req.stop_regex_checked = req.stop_regex_checked, len(req.text)
    try:  # cached after the first step; not on the search budget
        compile_patterns(patterns)
    except (RecursionError, ValueError, *INVALID) as exc:  # validate compiled them, on a shallower stack maybe
        return abort_reason(f"stop_regex could not be compiled here ({type(exc).__name__}); use a flatter pattern")
    for attempt in range(2):
        cpu = time.thread_time()
        try:
            return _first_match(patterns, req.text, checked)
        except StopRegexTooSlow as exc:
            # too slow when the searches used the time; when the thread waited instead (a loaded
            # host preempted it), once more on a fresh budget
            if attempt or time.thread_time() - cpu > SEARCH_TIMEOUT_S / 2:
                return abort_reason(str(exc))
    return None


def _first_match(patterns: list[str], text: str, checked: int) -> Optional[dict]:
    deadline = time.perf_counter() + SEARCH_TIMEOUT_S  # one budget for all of the request's patterns
    for pattern in patterns:
        if new_match(pattern, text, checked, deadline):
            return {"type": "stop", "matched": pattern}
    return None
