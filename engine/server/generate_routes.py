"""Generation routes: SGLang's /generate and the OpenAI-compatible /v1/completions and
/v1/chat/completions. Every request is validated and submitted before the response starts (a
bad streamed request is a 400, never a 200 that breaks off), and is aborted if its client
leaves (engine/server/disconnect.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request

from engine.sampling_params import carries_grammar
from engine.server.disconnect import await_or_abort, streaming_response
from engine.server.openai import OpenAIServing
from engine.server.openai_logprobs import token_decoder
from engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from engine.server.protocol import GenerateRequest, UnknownFields

LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
# per position, a list of [logprob, id, text] (or null): top_logprobs_num's and token_ids_logprob's
TOP_LOGPROB_LISTS = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                     "output_token_ids_logprobs")


def add_generate_routes(app: FastAPI, engine: Any, openai: OpenAIServing, unknown: UnknownFields) -> None:
    decode = token_decoder(engine.tokenizer)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, request: Request) -> Any:
        unknown.note("/generate", req)
        stream = await _submitted(lambda loop=None: engine.async_generate(**req.engine_kwargs(), stream=req.stream,
                                                                         loop=loop),
                                  carries_grammar(req.sampling_params))
        with_text = (lambda out: _logprob_texts(out, decode)) if req.return_text_in_logprobs else (lambda out: out)
        if req.stream:
            return streaming_response(_sse(stream, with_text), stream, engine)
        outs = await await_or_abort(request, stream, engine)
        return [with_text(o) for o in outs] if isinstance(outs, list) else with_text(outs)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        unknown.note("/v1/completions", req)
        stream = await _submitted(lambda loop=None: openai.submit_completion(req, loop), req.carries_grammar())
        if req.stream:
            return streaming_response(openai.completion_events(req, stream), stream, engine)
        return openai.completion_response(req, await await_or_abort(request, stream, engine))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        unknown.note("/v1/chat/completions", req)
        stream = await _submitted(lambda loop=None: openai.submit_chat(req, loop), req.carries_grammar())
        if req.stream:
            return streaming_response(openai.chat_events(req, stream), stream, engine)
        return openai.chat_response(req, await await_or_abort(request, stream, engine))


async def _submitted(submit: Callable[..., Any], constrained: bool) -> Any:
    """Build and submit a request. One that carries a grammar is built on a worker thread: its
    compile (tens of ms per new schema, ~0.5 s for the first on a Qwen-sized vocabulary) would
    otherwise stall every stream this event loop serves."""
    if not constrained:
        return submit()
    return await asyncio.to_thread(submit, asyncio.get_running_loop())


async def _sse(stream: AsyncIterator[dict], shape: Any) -> AsyncIterator[str]:
    async for chunk in stream:
        yield f"data: {json.dumps(shape(chunk))}\n\n"
    yield "data: [DONE]\n\n"


def _logprob_texts(out: dict, decode: Any) -> dict:
    """return_text_in_logprobs: each [logprob, id, null] entry gets its token's text."""
    meta = out["meta_info"]
    for key in LOGPROB_LISTS:
        if key in meta:
            meta[key] = [[lp, tok, decode(tok)] for lp, tok, *_ in meta[key]]
    for key in TOP_LOGPROB_LISTS:
        if key in meta:
            meta[key] = [None if pos is None else [[lp, tok, decode(tok)] for lp, tok, *_ in pos]
                         for pos in meta[key]]
    return out
