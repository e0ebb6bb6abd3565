"""Tokenizer loading, chat templates, and incremental detokenization for streaming output."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

# Tokens of the prompt re-decoded as left context, so the first output token decodes with the
# spacing it has in context (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET, vLLM's 5).
INIT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a half-finished UTF-8 sequence decodes to
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """Load a local HF tokenizer; tandem never reaches a model hub."""
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer path {path!r} is not a directory; pass a local checkpoint "
            "(build one with `tandem tiny-model --out DIR`)")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {path!r}: expected one of {', '.join(TOKENIZER_FILES)}")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                         local_files_only=True)


def check_text(text: str, what: str) -> int:
    """The text's UTF-8 size; a ValueError for text the tokenizer cannot encode: a lone UTF-16
    surrogate (JSON's "\\ud800" escape decodes to one) is no Unicode character and has no UTF-8 bytes."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: it has a lone surrogate {text[exc.start]!r} at "
                         f"character {exc.start} (send the character itself or its full surrogate pair)") from None


def apply_chat_template(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
                        assistant_prefix: str = "", check: Callable[[str, str], Any] = check_text,
                        **template_kwargs: Any) -> list[int]:
    """Render messages with the tokenizer's chat template and return the prompt's token ids.
    `assistant_prefix`: text the reply continues (SGLang's continue_final_message), appended to
    the rendered prompt before encoding. `check(text, what)` sees the rendered text before it is
    tokenized (a size limit refuses a long one there)."""
    text = render_chat_template(tokenizer, messages, add_generation_prompt, **template_kwargs) + assistant_prefix
    check(text, "the chat messages' text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_template(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
                         **template_kwargs: Any) -> str:
    if not getattr(tokenizer, "chat_template", None) and "chat_template" not in template_kwargs:
        raise ValueError("this tokenizer has no chat_template; send a plain prompt instead")
    # Render to text, then encode: the return type of tokenize=True differs between
    # transformers versions (list vs BatchEncoding); the text path is the same everywhere.
    from jinja2 import TemplateError

    # a request's own template (--trust-request-chat-template) fails in ways of its own: its fault
    faults = Exception if "chat_template" in template_kwargs else (TemplateError, TypeError, RecursionError,
                                                                   OverflowError)
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except faults as exc:
        # the template's raise_exception(...) refuses these messages, it met a value of the wrong
        # shape (a tojson of an undefined field), nesting too deep or a range past the sandbox's
        # limit: the request's fault, as in SGLang
        raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None


def trims_stop_token(finished_reason: Optional[dict], no_stop_trim: bool) -> bool:
    """Whether the reply's text leaves out its last token: a stop token it matched (SGLang's
    trim_matched_stop: an int `matched`), unless no_stop_trim."""
    matched = (finished_reason or {}).get("matched")
    return not no_stop_trim and isinstance(matched, int) and not isinstance(matched, bool)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a few tokens at a time.

    Two offsets into the ids, as in SGLang/vLLM: text is decoded from `surr_offset` (left
    context, already emitted) and everything past the decode of ids[surr_offset:read_offset] is
    new. New text that ends in U+FFFD is held back: the token ended inside a multi-byte character
    whose remaining bytes come with the next token.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Optional[Sequence[int]] = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._num_prompt = len(self._ids)
        self._read_offset = len(self._ids)
        self._surr_offset = max(len(self._ids) - INIT_CONTEXT_TOKENS, 0)
        self._text = ""
        self._before_add: Optional[tuple[int, int, int, int]] = None  # state before the last add, for drop_last

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until they complete)."""
        return self._text

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt:]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return only the newly completed text (maybe "")."""
        ids = [int(t) for t in token_ids]
        if ids:  # what drop_last goes back to (an empty add changes nothing)
            self._before_add = (len(self._ids), self._surr_offset, self._read_offset, len(self._text))
        self._ids.extend(ids)
        return self._advance(final=False)

    def drop_last(self) -> None:
        """Take the last output token back out of the text: SGLang's detokenizer leaves out the stop
        token a request matched (unless no_stop_trim), also where that token's text is printable
        (skip_special_tokens=False, or a plain token among stop_token_ids)."""
        if len(self._ids) == self._num_prompt or self._before_add is None:
            return
        n_ids, surr, read, n_text = self._before_add
        self._before_add = None
        again = self._ids[n_ids:-1]
        del self._ids[n_ids:]
        self._surr_offset, self._read_offset, self._text = surr, read, self._text[:n_text]
        self.add(again)

    def flush(self) -> str:
        """At finish: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context = self._decode(self._ids[self._surr_offset:self._read_offset])
        full = self._decode(self._ids[self._surr_offset:])
        if len(full) <= len(context) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing printable yet (e.g. a skipped special token) or mid-character
        new_text = full[len(context):]
        self._surr_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)
