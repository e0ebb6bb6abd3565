"""Generation routes: SGLang's /generate and the OpenAI-compatible /v1/completions and
/v1/chat/completions. Every request is validated and submitted before the response starts (a
bad streamed request is a 400, never a 200 that breaks off), and is aborted if its client
leaves (engine/server/disconnect.py). The three share one handler: a table row says each one's
body, the GenerateRequest it asks for and the shape of its reply."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request, Response

from engine.api.core_client import CoreDead
from engine.api.generate_request import GenerateRequest
from engine.api.generate_stream import json_size_estimate
from engine.server.disconnect import await_or_abort, streaming_response
from engine.server.openai import OpenAIServing
from engine.server.openai_logprobs import logprob_texts, token_decoder
from engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from engine.server.protocol import GenerateBody, UnknownFields
from engine.server.sse import json_bytes, sse_event
from engine.server.stream_delta import StreamDelta
from engine.server.stream_spacing import StreamSpacing

OFF_LOOP_TEXT_CHARS = 16 << 10  # ~10 ms to tokenize: more is tokenized on a thread
SMALL_REPLY_BYTES = 16 << 10  # well under a ms to shape and serialize: more is a reply thread's work


@dataclass(frozen=True)
class GenerationRoute:
    """One generation route: its body, the GenerateRequest a body asks for, and how the engine's
    outputs become the reply (final outputs) or the SSE events (a stream of cumulative chunks)."""
    path: str
    body: type
    request: Callable[[Any], GenerateRequest]
    response: Callable[[Any, Any], Any]  # (body, final outputs) -> reply
    events: Callable[[Any, Any], AsyncIterator[str]]  # (body, stream) -> SSE lines
    off_loop: Callable[[Any], bool]  # (body) -> whether building its request is work for a thread
    methods: tuple[str, ...] = ("POST",)
    # (body) -> whether its reply is its outputs as they are (then a small one is shaped on the loop);
    # the OpenAI replies decode prompts and tokens (echo, logprobs): always a reply thread's work
    plain_reply: Callable[[Any], bool] = lambda body: False


def generation_routes(engine: Any, openai: OpenAIServing) -> tuple[GenerationRoute, ...]:
    decode = token_decoder(engine.tokenizer)
    incremental = engine.server_args.incremental_streaming_output
    return (
        GenerationRoute("/generate", GenerateBody, GenerateBody.to_request, partial(_generate_response, decode),
                        partial(_generate_events, decode, incremental), lambda body: _long_text(body.text),
                        methods=("POST", "PUT"), plain_reply=lambda body: not body.return_text_in_logprobs),
        GenerationRoute("/v1/completions", CompletionRequest, openai.completion_request, openai.completion_response,
                        openai.completion_events, lambda body: _long_text(body.prompt)),
        # the chat template renders the client's messages: a thread, whatever their size
        GenerationRoute("/v1/chat/completions", ChatCompletionRequest, openai.chat_request, openai.chat_response,
                        openai.chat_events, lambda body: True),
    )


def add_generate_routes(app: FastAPI, engine: Any, openai: OpenAIServing, unknown: UnknownFields) -> None:
    for route in generation_routes(engine, openai):
        _add_route(app, engine, route, unknown)


def _add_route(app: FastAPI, engine: Any, route: GenerationRoute, unknown: UnknownFields) -> None:
    async def handle(body: Any, request: Request) -> Any:
        unknown.note(route.path, body)
        since = engine.abort_mark()  # an abort while the request is built (its grammar, its template) ends it

        def submit(loop: Any = None) -> Any:
            return engine.async_generate(route.request(body), loop=loop, aborts_since=since)
        stream = await _submitted(submit, body.carries_grammar() or route.off_loop(body))
        if body.stream:
            return streaming_response(route.events(body, stream), stream, engine)
        outs = await await_or_abort(request, stream, engine)
        _raise_if_core_died(outs)
        if route.plain_reply(body) and _small(outs):  # a thread's hand-over would cost more than the work
            return _json_reply(route.response, body, outs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_REPLY_THREADS, _json_reply, route.response, body, outs)

    handle.__annotations__ = {"body": route.body, "request": Request, "return": Any}  # FastAPI parses by these
    app.api_route(route.path, methods=list(route.methods))(handle)


def _json_reply(response: Callable[[Any, Any], Any], body: Any, outs: Any) -> Response:
    """A final reply, shaped and serialized on a worker thread: with prompt or top logprobs it can
    be 100 MB of JSON (seconds of work the event loop, and so /health and every stream, would wait
    for). Serialized as FastAPI serializes a route's return value (non-finite floats as null)."""
    return Response(json_bytes(response(body, outs)), media_type="application/json")


def _small(outs: Any) -> bool:
    """Outputs quick to serialize on the loop (no long logprob tables or routed experts)."""
    return sum(json_size_estimate(out) for out in _as_list(outs)) <= SMALL_REPLY_BYTES


def _as_list(outs: Any) -> list:
    return outs if isinstance(outs, list) else [outs]


def _raise_if_core_died(outs: Any) -> None:
    """A request the dead core's client ended (Engine.fail_all_requests) answers 503, as SGLang
    answers an abort that carries status 503, not a 200 with an abort reason."""
    for out in _as_list(outs):
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("status_code") == 503:
            raise CoreDead(reason.get("message", "the engine core is gone"))


# Threads that build heavy requests: a grammar's compile waits up to its time limit
# (engine/grammar/compile_pool.py), so these are their own, never the loop's default executor.
_SUBMIT_THREADS = ThreadPoolExecutor(64, thread_name_prefix="tandem-submit")
# Final replies are shaped on their own threads: not behind a weight update's or a stats call's
# wait in the loop's default executor
_REPLY_THREADS = ThreadPoolExecutor(8, thread_name_prefix="tandem-reply")


async def _submitted(submit: Callable[..., Any], heavy: bool) -> Any:
    """Build and submit a request. A heavy one is built on a worker thread: a grammar's compile
    (tens of ms per new schema, ~0.5 s for the first on a Qwen-sized vocabulary, up to
    --grammar-compile-timeout), a chat template's render or a long text's tokenizing (~0.7 s per
    MB) would otherwise stall every stream and /health this event loop serves."""
    if not heavy:
        return submit()
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_SUBMIT_THREADS, submit, loop)


def _long_text(prompt: Any) -> bool:
    """Text worth a thread to tokenize: over OFF_LOOP_TEXT_CHARS in all (token ids need none)."""
    if isinstance(prompt, str):
        return len(prompt) > OFF_LOOP_TEXT_CHARS
    texts = prompt if isinstance(prompt, list) else []
    return sum(len(t) for t in texts if isinstance(t, str)) > OFF_LOOP_TEXT_CHARS


def _generate_response(decode: Any, body: GenerateBody, outs: Any) -> Any:
    shape = _shape(body, decode)
    return [shape(o) for o in outs] if isinstance(outs, list) else shape(outs)


async def _generate_events(decode: Any, incremental: bool, body: GenerateBody,
                           stream: AsyncIterator[dict]) -> AsyncIterator[str]:
    shape = _shape(body, decode)
    delta = StreamDelta() if incremental else (lambda chunk: chunk)
    send = (lambda chunk: True) if incremental else StreamSpacing()
    async for chunk in stream:
        if send(chunk):
            yield sse_event(shape(delta(chunk)))
    yield "data: [DONE]\n\n"


def _shape(body: GenerateBody, decode: Any) -> Callable[[dict], dict]:
    return (lambda out: logprob_texts(out, decode)) if body.return_text_in_logprobs else (lambda out: out)

