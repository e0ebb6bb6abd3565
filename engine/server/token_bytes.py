"""A token's own bytes, for the chat logprobs' `bytes` field.

A byte-level BPE token may be part of a multi-byte character (one of the three bytes of "世"):
alone it decodes to U+FFFD, whose UTF-8 ([239, 191, 189]) is what SGLang sends as its bytes
(serving_chat.py: `list(token.encode("utf-8"))`). OpenAI sends the token's bytes, so a client can
join them into the reply's text. Those are readable from the vocabulary: a byte-level token is
spelled in GPT-2's byte alphabet, a SentencePiece byte-fallback token as "<0xE4>". Where neither
applies (added tokens, ids past the vocabulary, other tokenizers) the decoded text's UTF-8 stands,
as SGLang's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

TokenBytes = Callable[[int, str], list[int]]  # (token id, its decoded text) -> its bytes
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: printable bytes spell themselves, the others
    chr(256 + k) in byte order (tokenizers' ByteLevel.alphabet())."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    spelled.update({b: chr(256 + k) for k, b in enumerate(b for b in range(256) if b not in spelled)})
    return {char: b for b, char in spelled.items()}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence's members too); empty when unknown."""
    try:
        config = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # a slow tokenizer, a stub, no decoder: the text's UTF-8 stands
        return set()
    parts = config.get("decoders") or [config]
    return {part.get("type") for part in parts if isinstance(part, dict)}


def token_bytes(tokenizer: Any) -> TokenBytes:
    kinds = _decoder_kinds(tokenizer)
    if not kinds & {"ByteLevel", "ByteFallback"}:
        return lambda token_id, text: list(text.encode("utf-8"))
    alphabet = byte_alphabet() if "ByteLevel" in kinds else None
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # spelled as themselves, not in bytes

    def read(token_id: int, text: str) -> list[int]:
        piece = None if token_id in added else tokenizer.convert_ids_to_tokens(token_id)
        raw = _raw_bytes(piece, alphabet) if isinstance(piece, str) else None
        return list(text.encode("utf-8")) if raw is None else raw

    return read


def _raw_bytes(piece: str, alphabet: Optional[dict[str, int]]) -> Optional[list[int]]:
    if alphabet is not None:  # byte-level: every character is one byte, or this is no byte-level piece
        raw = [alphabet.get(char) for char in piece]
        return None if None in raw else raw
    match = _FALLBACK_BYTE.fullmatch(piece)  # SentencePiece: only its byte tokens are unambiguous
    return [int(match.group(1), 16)] if match else None
