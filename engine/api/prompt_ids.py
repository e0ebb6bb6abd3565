"""PromptIds: a request's prompts as checked token-id lists (text tokenized as generate does).

Text or input_ids, one prompt or a batch; both given is SGLang's case of input_ids as the prompt
with the text riding along. Every check runs before any prompt is tokenized or sent: the batch's
size, each text's size (PromptSize), each id list's types, vocabulary range and length.
"""

from __future__ import annotations

from typing import Any

from engine.api.prompt_size import PromptSize


class PromptIds:
    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int, prompt_size: PromptSize,
                 max_batch_requests: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.prompt_size = prompt_size
        self.max_batch_requests = max_batch_requests

    def token_lists(self, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        """The prompts' token ids (text tokenized as generate does), checked; and whether one
        prompt was given (not a list of them)."""
        self._check_prompt_count(prompt, input_ids)  # before any per-prompt work
        if prompt is not None and input_ids is not None:
            check_same_batch(prompt, input_ids)
            prompt = None  # SGLang's rule: input_ids is the prompt, the text only rides along
        if prompt is None and input_ids is None:
            raise ValueError("one of prompt (text) or input_ids is required")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and not isinstance(prompt, (list, tuple)):
                raise ValueError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            if self.tokenizer is None:
                raise ValueError("this engine was started with skip_tokenizer_init; pass input_ids")
            for text in texts:  # every text measured before any is tokenized
                self._check_text(text)
            lists = [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        else:
            if not isinstance(input_ids, (list, tuple)):  # a dict or a str would iterate as if it were ids
                raise ValueError(f"input_ids must be a list of ints (or a list of such lists), "
                                 f"got {type(input_ids).__name__}")
            # one prompt unless the first entry is a list (each entry is checked by _check_ids)
            single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
            lists = [list(input_ids)] if single else [list(x) if isinstance(x, (list, tuple)) else x for x in input_ids]
        if not lists:
            raise ValueError("prompt or input_ids is empty: give at least one token")
        for ids in lists:
            self._check_ids(ids)
        return lists, single

    def _check_prompt_count(self, prompt: Any, input_ids: Any) -> None:
        """A batch over the limit is refused before its prompts are checked or tokenized: 2M
        one-token prompts (10 MB of JSON) took 38 s to refuse, the event loop blocked throughout."""
        batch = prompt if prompt is not None else input_ids
        many = isinstance(batch, (list, tuple)) and bool(batch) and (
            prompt is not None or isinstance(batch[0], (list, tuple)))
        if many and len(batch) > self.max_batch_requests:
            raise ValueError(f"this call asks for {len(batch)} prompts; the limit is {self.max_batch_requests} "
                             f"requests (prompts x n) a call (--max-batch-requests): split it")

    def _check_text(self, text: str) -> None:
        if text == "":
            raise ValueError("prompt is empty; give at least one token of text")
        self.prompt_size.check(text)

    def _check_ids(self, ids: Any) -> None:
        # set of types + min/max: ~20x faster than per-token isinstance and range checks, and this
        # runs on the serving path for every prompt (bool is its own type, so it is refused)
        if not isinstance(ids, list) or not {type(t) for t in ids} <= {int}:
            raise ValueError("input_ids must be a list of ints (or a list of such lists)")
        if not ids:
            raise ValueError("prompt is empty: input_ids has no tokens")
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"input_ids has token id {bad} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_len:  # SGLang's words (clients match them), then what to do
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens). A prompt must leave room for at least one new token: "
                             f"shorten it, or raise context_length: `--context-length` for serve, "
                             f"`--engine-args '{{\"context_length\": N}}'` for train")


def check_same_batch(prompt: Any, input_ids: Any) -> None:
    """Text and input_ids given together (SGLang takes input_ids then) must describe the same batch:
    one prompt each, or lists of the same length."""
    lists = (str, list, tuple)
    if (isinstance(prompt, lists) and not prompt) or (isinstance(input_ids, lists) and not input_ids):
        raise ValueError("prompt or input_ids is empty: give at least one token")
    text_batch = len(prompt) if isinstance(prompt, (list, tuple)) else None
    batched_ids = isinstance(input_ids, (list, tuple)) and isinstance(input_ids[0], (list, tuple))
    ids_batch = len(input_ids) if batched_ids else None
    if text_batch != ids_batch:
        what = lambda n: "one prompt" if n is None else f"a batch of {n}"  # noqa: E731
        raise ValueError(f"text ({what(text_batch)}) and input_ids ({what(ids_batch)}) disagree: pass one of "
                         "them (when both are given, input_ids is the prompt, as in SGLang)")
