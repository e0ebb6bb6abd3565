"""Stop checks, in SGLang's order: length, then (after min_new_tokens) stop strings, stop
regexes, then EOS and stop tokens."""

from __future__ import annotations

import re

from typing import Optional

from engine.scheduler.request import Req


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
    if matched is None:
        matched = _match_stop_regex(req)
    if matched is not None:
        return {"type": "stop", "matched": matched}
    token = req.output_ids[-1]
    if token in (params.stop_token_ids or ()) or (not params.ignore_eos and token in eos_token_ids):
        return {"type": "stop", "matched": token}
    return None


def _match_stop_string(req: Req) -> Optional[str]:
    """Finds a stop string in the tail of the text; trims the text there unless no_stop_trim."""
    stops = req.sampling_params.stop
    if not stops or not req.text:
        return None
    window = max(len(s) for s in stops) + 16  # new text of one token is short; look a bit further
    tail_start = max(len(req.text) - window, 0)
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        idx = req.text.find(stop, tail_start)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    req.stop_text_len = best[0]
    if not req.sampling_params.no_stop_trim:
        req.text = req.text[: best[0]]
    return best[1]


def _match_stop_regex(req: Req) -> Optional[str]:
    """The first stop_regex found in the text so far; the text is kept whole, as SGLang keeps it
    (its trim looks for the pattern itself in the text). The whole text is searched: a pattern
    such as `answer: \\d+\\.` may start far back, and a match can only end in the new token."""
    patterns = req.sampling_params.stop_regex
    if not patterns or not req.text:
        return None
    for pattern in patterns:
        if re.search(pattern, req.text):
            return pattern
    return None
