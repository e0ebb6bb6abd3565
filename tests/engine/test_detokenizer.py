"""IncrementalDetokenizer: streamed pieces add up to the full decode, never half a character."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.testing.tiny_model import tiny_model_path
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "emoji 😀🚀❤️👍🏽 🇫🇷 done",
    "tabs\tand\nnew lines  with  spaces",
    "Ελληνικά και русский и 中文 mixed 123 + 456 = 579",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_path())


def _stream(tok, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return detok, pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_concatenate_to_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    detok, pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == tok.decode(ids) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_split_multibyte_character_is_held_back(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character spread over several tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "😀"


def test_flush_emits_incomplete_tail_at_finish(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    streamed = detok.add(ids[:-1])
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert tail.endswith("\ufffd")  # an unfinished character at the end stays visible
    assert detok.flush() == ""


def test_prompt_gives_context_but_is_not_emitted(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    output = tok.encode(" Paris, of course.", add_special_tokens=False)
    detok, pieces = _stream(tok, output, prompt_ids=prompt)
    assert "".join(pieces) == " Paris, of course."
    assert detok.output_ids == output


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert "".join(_stream(tok, ids)[1]) == "Hi"
    assert "".join(_stream(tok, ids, skip_special_tokens=False)[1]) == "Hi<|im_end|>"


def test_ids_past_the_tokenizer_vocab_do_not_crash(tok):
    detok = IncrementalDetokenizer(tok)
    detok.add(tok.encode("a", add_special_tokens=False))
    detok.add([len(tok) + 5])  # models pad vocab past the tokenizer; such ids decode to nothing
    assert detok.text + detok.flush() == "a"


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
                    max_size=40),
       chunk=st.integers(1, 4))
def test_any_text_streams_exactly(tok, text, chunk):
    # special-token strings encode to special ids, which decoding skips (tested above); hypothesis
    # draws string constants from the source, so it does produce them
    specials = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assume(not any(special in text for special in specials))
    ids = tok.encode(text, add_special_tokens=False)
    detok, pieces = _stream(tok, ids, chunk)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS[:3] + ["Hi<|im_end|>"])
@pytest.mark.parametrize("chunk", [1, 2, 5, 100])
def test_drop_last_gives_the_text_without_the_last_token(tok, text, chunk):
    """SGLang's text leaves out a matched stop token (trim_matched_stop): drop_last after any
    chunking gives the decode of all ids but the last, the same as never having fed it."""
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    want = tok.decode(prompt + ids[:-1], skip_special_tokens=False)[len(tok.decode(prompt)):]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    for i in range(0, len(ids), chunk):
        detok.add(ids[i:i + chunk])
    detok.add([])  # an empty add (nothing new this step) changes nothing
    detok.drop_last()
    detok.flush()
    assert detok.text == want and detok.output_ids == ids[:-1]


def test_trims_stop_token_follows_sglang():
    from engine.tokenizer import trims_stop_token

    assert trims_stop_token({"type": "stop", "matched": 7}, no_stop_trim=False)
    assert not trims_stop_token({"type": "stop", "matched": 7}, no_stop_trim=True)
    assert not trims_stop_token({"type": "stop", "matched": "###"}, no_stop_trim=False)  # a stop string: trimmed apart
    assert not trims_stop_token({"type": "length", "length": 4}, no_stop_trim=False)
    assert not trims_stop_token(None, no_stop_trim=False)
