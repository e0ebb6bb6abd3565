"""PromptSize: a prompt's text is measured before it is tokenized.

Tokenizing costs time and memory in proportion to the text (a 60 MB prompt stalled every client
for 15 s and then failed to allocate), and a text far past the context can never be served. No
token covers more bytes than the tokenizer's longest vocabulary entry, so a text over
context length x that many bytes cannot fit the context whatever it says: it is refused unread.
`--max-prompt-bytes` sets the limit instead. The check reads the length first, which costs
nothing, and encodes only a text that passed it.
"""

from __future__ import annotations

from typing import Any, Optional

from engine.tokenizer import check_text

MIN_BYTES_PER_TOKEN = 4  # one UTF-8 character: what an unknown-token piece may stand for


class PromptSize:
    def __init__(self, tokenizer: Any, context_len: int, max_prompt_bytes: Optional[int] = None) -> None:
        self.from_flag = max_prompt_bytes is not None
        self.bytes_per_token = longest_token_bytes(tokenizer) if tokenizer is not None else MIN_BYTES_PER_TOKEN
        self.context_len = context_len
        self.max_bytes = max_prompt_bytes if self.from_flag else context_len * self.bytes_per_token

    def check(self, text: str, what: str = "prompt") -> None:
        """A ValueError unless `text` is valid Unicode of at most max_bytes UTF-8 bytes."""
        if len(text) > self.max_bytes:  # a character is at least one byte: no need to encode it
            self._refuse(what, f"{len(text):,} characters")
        size = check_text(text, what)
        if size > self.max_bytes:
            self._refuse(what, f"{size:,} bytes")

    def _refuse(self, what: str, size: str) -> None:
        source = "--max-prompt-bytes" if self.from_flag else (
            f"the context length {self.context_len} x {self.bytes_per_token} bytes, the longest token: a longer "
            f"text cannot fit the context; --max-prompt-bytes changes it")
        raise ValueError(f"{what} has {size}, over the limit of {self.max_bytes:,} UTF-8 bytes ({source}); "
                         "it was refused before tokenizing")


def longest_token_bytes(tokenizer: Any) -> int:
    """The UTF-8 size of the longest vocabulary entry (byte-level BPE spells a byte as a character
    of up to 2 bytes, so this is an upper bound on the text a token stands for)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=0)
    return max(longest, MIN_BYTES_PER_TOKEN)
