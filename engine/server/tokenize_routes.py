"""SGLang's /tokenize and /detokenize (and their /v1/ forms): the served model's tokenizer over HTTP.

Bodies and replies are SGLang's (entrypoints/openai/serving_tokenize.py): a prompt (one string or
a list) -> {"tokens", "count", "max_model_len"}, each a list when the prompt was; or chat messages,
rendered as /v1/chat/completions renders them (add_generation_prompt, continue_final_message) -> the
prompt's tokens; tokens (one list
of ids or a list of lists) -> {"text"}, a list when the tokens were. max_model_len is the context
length this server enforces. The work scales with the body, so it runs off the event loop; an id
outside the vocabulary, text that is no Unicode (a lone surrogate) or a prompt over the size a
generation route takes is a 400 naming it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from engine.server.chat_messages import check_nesting, template_messages
from engine.server.openai_protocol import TokenizeRequest
from engine.server.protocol import DetokenizeRequest, UnknownFields
from engine.server.template_content import template_content_format
from engine.tokenizer import apply_chat_template


def add_tokenize_routes(app: FastAPI, engine: Any, unknown: UnknownFields) -> None:
    tokenizer = engine.tokenizer
    context_len = engine.info.context_len
    vocab_size = engine.info.vocab_size

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        unknown.note("/tokenize", req)
        _need(tokenizer)

        def encode(text: str) -> list[int]:
            engine.builder.prompt_size.check(text, "prompt")  # the limit /generate applies, and valid text
            return list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))

        if req.messages is not None:
            tokens: Any = await asyncio.to_thread(render, req)
            count: Any = len(tokens)
        elif isinstance(req.prompt, str):
            tokens = await asyncio.to_thread(encode, req.prompt)
            count = len(tokens)
        else:
            tokens = await asyncio.to_thread(lambda: [encode(text) for text in req.prompt])
            count = [len(ids) for ids in tokens]
        return {"tokens": tokens, "count": count, "max_model_len": context_len}

    def render(req: TokenizeRequest) -> list[int]:
        """The chat route's prompt: with continue_final_message the last assistant message is the
        start of the reply (its header rendered), else the generation prompt as asked."""
        messages, prefix = template_messages(req.messages, template_content_format(tokenizer),
                                             req.continue_final_message)
        check_nesting(messages, "messages")
        generation_prompt = req.add_generation_prompt or prefix is not None
        return apply_chat_template(tokenizer, messages, add_generation_prompt=generation_prompt,
                                   assistant_prefix=prefix or "", check=engine.builder.prompt_size.check)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        unknown.note("/detokenize", req)
        _need(tokenizer)
        nested = bool(req.tokens) and isinstance(req.tokens[0], list)
        lists = req.tokens if nested else [req.tokens]
        for ids in lists:
            _check_ids(ids, vocab_size)

        def decode() -> list[str]:
            return [tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in lists]

        texts = await asyncio.to_thread(decode)
        return {"text": texts if nested else texts[0]}


def _need(tokenizer: Any) -> None:
    if tokenizer is None:
        raise ValueError("this server was started with --skip-tokenizer-init: it has no tokenizer")


def _check_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
