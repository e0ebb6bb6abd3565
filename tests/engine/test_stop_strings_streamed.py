"""A stream never sends text its final answer takes back: the tail that could still grow into a
stop string is held until the text completes the string (and is trimmed) or leaves it."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.scheduler.finish import stop_prefix_len

PROMPT = "The quick brown fox"
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3),            # "wor" begins "world"
    ("hello world", ["world"], 0),          # complete: the stop check trims it, nothing to hold
    ("hello w", ["xyz", "wo", "w!"], 1),
    ("abab", ["abac"], 2),                  # "ab" begins it; "bab" and "abab" do not
    ("aaaa", ["aaab"], 3),
    ("abc", ["c", "bcd"], 2),               # a one-character stop is never partial; "bc" begins "bcd"
    ("", ["x"], 0),
    ("no match here", ["zz"], 0),
    ("tail", None, 0),
])
def test_stop_prefix_len(text, stops, held):
    assert stop_prefix_len(text, stops) == held


def test_stop_prefix_len_is_the_longest_tail_over_every_string():
    text = "x" * 100 + "abcde"
    assert stop_prefix_len(text, ["deX", "bcdeY", "cdeZ"]) == 4
    # brute force over every tail, as a reference
    stops = ["cdeab", "eab", "de", "abcdefg"]
    want = max([n for n in range(1, len(text) + 1) for s in stops
                if len(s) > n and s.startswith(text[-n:])], default=0)
    assert stop_prefix_len(text, stops) == want == 5


def test_the_kept_scan_answers_as_a_fresh_search_while_the_text_grows():
    """stop_prefix_len with its per-string scan state, over texts growing a few characters at a
    time, against the same search from scratch (and a brute force over every tail)."""
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text, scan = "", [0] * len(stops)
        while len(text) < 40:
            text += "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            brute = max([n for n in range(1, len(text) + 1) for s in stops
                         if len(s) > n and s.startswith(text[-n:])], default=0)
            assert stop_prefix_len(text, stops, scan) == stop_prefix_len(text, stops) == brute, (stops, text)


def _token_texts(engine) -> tuple[list[int], list[str]]:
    ref = engine.generate(prompt=PROMPT, sampling_params=GREEDY)
    tok = engine.local_core.tokenizer
    ids = ref["output_ids"]
    return ids, [tok.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]


def _stop_across_two_tokens(texts: list[str]) -> tuple[str, int]:
    """A stop string whose first two characters end one token's text and whose rest begins the
    next token's, occurring first there; and where it starts in the text."""
    full = texts[-1]
    for before, after in zip(texts, texts[1:]):
        if not full.startswith(after) or len(before) < 2 or len(after) - len(before) < 2:
            continue
        stop = full[len(before) - 2: len(before) + 2]
        if stop.strip() and full.find(stop) == len(before) - 2:
            return stop, len(before) - 2
    pytest.skip("no stop string across two tokens in this model's greedy text")


async def _stream(engine, params: dict) -> list[dict]:
    return [chunk async for chunk in engine.async_generate(prompt=PROMPT, stream=True, sampling_params=params)]


def test_a_stream_never_sends_the_start_of_a_stop_string_it_trims(engine):
    _, texts = _token_texts(engine)
    stop, at = _stop_across_two_tokens(texts)
    chunks = asyncio.run(_stream(engine, {**GREEDY, "stop": [stop]}))
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert final["text"] == texts[-1][:at]
    sent = [c["text"] for c in chunks]
    assert all(final["text"].startswith(t) for t in sent), (stop, sent)  # nothing taken back
    assert all(b.startswith(a) for a, b in zip(sent, sent[1:]))


def test_held_text_is_released_when_the_text_leaves_the_stop_string(engine):
    _, texts = _token_texts(engine)
    stop, at = _stop_across_two_tokens(texts)
    never = stop[:2] + "\x00"  # begins where the stop string did, then parts from the text
    chunks = asyncio.run(_stream(engine, {**GREEDY, "stop": [never]}))
    assert chunks[-1]["text"] == texts[-1] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    n = _tokens_ending(texts, at + 2)
    held, released = _chunk_with(chunks, n), _chunk_with(chunks, n + 1)
    if held is not None:  # (a lagging reader gets only the newest chunk)
        assert held["text"] == texts[n][:at]
    if released is not None:
        assert released["text"] == texts[n + 1]


def test_no_stop_trim_streams_every_character(engine):
    _, texts = _token_texts(engine)
    stop, at = _stop_across_two_tokens(texts)
    chunks = asyncio.run(_stream(engine, {**GREEDY, "stop": [stop], "no_stop_trim": True}))
    assert chunks[-1]["text"].startswith(texts[-1][:at] + stop)
    n = _tokens_ending(texts, at + 2)
    chunk = _chunk_with(chunks, n)
    if chunk is not None:
        assert chunk["text"] == texts[n]


def _tokens_ending(texts: list[str], length: int) -> int:
    """How many tokens make a text of `length` characters."""
    return next(n for n, t in enumerate(texts) if len(t) == length)


def _chunk_with(chunks: list[dict], num_tokens: int):
    return next((c for c in chunks if len(c["output_ids"]) == num_tokens), None)


@pytest.mark.parametrize("min_new_tokens", [0, 3, 5, 8])
def test_a_stop_string_before_min_new_tokens_is_held_until_the_check_passes_it(engine, min_new_tokens):
    """Before min_new_tokens a whole stop string is not matched; once the check runs it still finds
    one in the tail it searches and trims there: the stream must not have sent it meanwhile."""
    _, texts = _token_texts(engine)
    stop, at = _stop_across_two_tokens(texts)
    params = {**GREEDY, "stop": [stop], "min_new_tokens": min_new_tokens}
    chunks = asyncio.run(_stream(engine, params))
    whole = engine.generate(prompt=PROMPT, sampling_params=params)
    assert chunks[-1]["text"] == whole["text"]
    assert all(whole["text"].startswith(c["text"]) for c in chunks), [c["text"] for c in chunks]
