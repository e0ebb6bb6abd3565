"""OpenAI-route details against SGLang's serving_chat.py and OpenAI's reply shape: each chat
logprob's `bytes` are its token's own (a byte-level token that is part of a character decodes to
U+FFFD alone, yet its bytes join with its neighbours' into the text), and top_logprobs past
OpenAI's 20 are served, as SGLang serves them (bounded by the vocabulary only)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from engine.server.token_bytes import byte_alphabet, token_bytes

USER = [{"role": "user", "content": "Hi"}]
PARTIAL = "ä"  # the byte-level spelling of byte 0xE4: the first of three in "世", U+FFFD alone


def _forced_partial(engine, **extra) -> dict:
    """A chat body whose one output token is the lone byte 0xE4 (logit_bias forces it); its
    top_logprobs (the unbiased distribution's) list the whole vocabulary."""
    token_id = engine.tokenizer.convert_tokens_to_ids(PARTIAL)
    return {"messages": USER, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": len(engine.tokenizer), "logit_bias": {str(token_id): 100}, **extra}


def test_chat_logprob_bytes_of_a_partial_character_are_the_tokens_own(client, engine):
    """Was [239, 191, 189] (U+FFFD's UTF-8, as SGLang sends); OpenAI's are the token's byte."""
    out = client.post("/v1/chat/completions", json=_forced_partial(engine)).json()
    entry = out["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xE4]  # the text as SGLang's; the bytes as OpenAI's
    partial = [top["bytes"] for top in entry["top_logprobs"] if top["token"] == "\ufffd"]
    assert [0xE4] in partial and [239, 191, 189] not in partial
    with client.stream("POST", "/v1/chat/completions", json=_forced_partial(engine, stream=True)) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [e for ev in events for c in ev["choices"] for e in (c.get("logprobs") or {}).get("content", [])]
    assert [e["bytes"] for e in streamed] == [[0xE4]]


def test_token_bytes_join_into_the_texts_utf8(engine):
    tok = engine.tokenizer
    read = token_bytes(tok)
    text = "世界 ok é ∑ <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some token is part of a character
    assert b"".join(bytes(read(i, tok.decode([i]))) for i in ids) == text.encode("utf-8")
    assert read(10**6, "") == []  # an id past the vocabulary: its (empty) text's


def test_token_bytes_of_other_tokenizers():
    """SentencePiece's byte-fallback tokens are one byte each; other pieces and tokenizers without
    a byte-level decoder keep the decoded text's UTF-8 (SGLang's)."""
    decoder = SimpleNamespace(__getstate__=lambda: json.dumps({"type": "Sequence", "decoders": [
        {"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"}]}).encode())
    pieces = {1: "<0xE4>", 2: "▁Hello"}
    spm = SimpleNamespace(backend_tokenizer=SimpleNamespace(decoder=decoder), added_tokens_decoder={},
                          convert_ids_to_tokens=pieces.get)
    read = token_bytes(spm)
    assert read(1, "\ufffd") == [0xE4] and read(2, " Hello") == list(b" Hello")
    assert token_bytes(SimpleNamespace())(5, "\ufffd") == [239, 191, 189]
    assert token_bytes(None)(5, "x") == [120]
    assert sorted(byte_alphabet().values()) == list(range(256))


def test_top_logprobs_past_openais_20_are_served(client):
    """SGLang takes any top_logprobs (its protocol.py has no bound; its tokenizer manager bounds
    top_logprobs_num by the vocabulary), where OpenAI caps it at 20: served, not refused."""
    body = {"messages": USER, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 25}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert [len(e["top_logprobs"]) for e in resp.json()["choices"][0]["logprobs"]["content"]] == [25, 25]
