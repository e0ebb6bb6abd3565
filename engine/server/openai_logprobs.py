"""OpenAI logprob shapes built from SGLang-style meta_info lists ([logprob, token id, text]).

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{text: lp}], "text_offset"}.
Chat: {"content": [{"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]}]}.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from engine.server.token_bytes import TokenBytes

Decode = Callable[[int], str]
LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
# per position, a list of [logprob, id, text] (or null): top_logprobs_num's and token_ids_logprob's
TOP_LOGPROB_LISTS = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                     "output_token_ids_logprobs")


def token_decoder(tokenizer: Any) -> Decode:
    if tokenizer is None:
        return str
    return lambda token_id: tokenizer.decode([token_id])


def completion_logprobs(entries: list, tops: list, decode: Decode, offset: int = 0) -> dict:
    """entries: [[lp, id, _]]; tops: per position a list of [lp, id, _] or None. text_offset
    counts characters from `offset` (the length of the text before these tokens)."""
    tokens = [decode(tok) for _, tok, *_ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [_top_dict(tops[i], decode) if i < len(tops) else None for i in range(len(entries))]
    return {"tokens": tokens, "token_logprobs": [lp for lp, *_ in entries], "top_logprobs": top,
            "text_offset": offsets}


def _top_dict(entry: Optional[list], decode: Decode) -> Optional[dict[str, float]]:
    if entry is None:
        return None
    out: dict[str, float] = {}
    for lp, tok, *_ in entry:
        out.setdefault(decode(tok), lp)  # equal texts collapse; the first is the likeliest
    return out


def _utf8(token_id: int, text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list, tops: list, decode: Decode, to_bytes: TokenBytes = _utf8) -> dict:
    """`to_bytes` gives each token's bytes (token_bytes.py: its own, where the vocabulary tells)."""
    content = []
    for i, (lp, tok, *_) in enumerate(entries):
        top = tops[i] if i < len(tops) and tops[i] is not None else []
        content.append({**_chat_token(tok, lp, decode, to_bytes),
                        "top_logprobs": [_chat_token(t, v, decode, to_bytes) for v, t, *_ in top]})
    return {"content": content}


def _chat_token(token_id: int, logprob: float, decode: Decode, to_bytes: TokenBytes) -> dict:
    text = decode(token_id)
    return {"token": text, "bytes": to_bytes(token_id, text), "logprob": logprob}


def output_entries(meta: dict, start: int = 0) -> tuple[list, list]:
    """(output_token_logprobs, output_top_logprobs) from position `start` on."""
    return meta.get("output_token_logprobs", [])[start:], meta.get("output_top_logprobs", [])[start:]


def echo_entries(meta: dict) -> tuple[list, list]:
    """Prompt then output entries, for completions with echo (the first prompt logprob is null)."""
    prompt = meta.get("input_token_logprobs", [])
    prompt_tops = meta.get("input_top_logprobs") or [None] * len(prompt)
    out, out_tops = output_entries(meta)
    return prompt + out, list(prompt_tops) + list(out_tops)


def logprob_texts(out: dict, decode: Decode) -> dict:
    """SGLang's return_text_in_logprobs: each [logprob, id, null] entry of an output's meta_info
    gets its token's text (in place)."""
    meta = out["meta_info"]
    for key in LOGPROB_LISTS:
        if key in meta:
            meta[key] = [[lp, tok, decode(tok)] for lp, tok, *_ in meta[key]]
    for key in TOP_LOGPROB_LISTS:
        if key in meta:
            meta[key] = [None if pos is None else [[lp, tok, decode(tok)] for lp, tok, *_ in pos]
                         for pos in meta[key]]
    return out
