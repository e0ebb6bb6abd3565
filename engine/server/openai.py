"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of Engine.async_generate."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from engine.server.protocol import ChatCompletionRequest, CompletionRequest, openai_sampling_params


def _finish_reason(meta: dict) -> Optional[str]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(reason["type"], reason["type"])


def _usage(outs: list[dict]) -> dict:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs) // max(len(outs), 1) if outs else 0
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIServing:
    def __init__(self, engine: Any, model_name: str):
        self.engine = engine
        self.model_name = model_name

    # ---- completions ---------------------------------------------------------------------------
    def _completion_inputs(self, req: CompletionRequest) -> dict:
        prompt = req.prompt
        key = "input_ids" if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str) else "prompt"
        return {key: prompt, "sampling_params": openai_sampling_params(req, req.max_tokens),
                "return_logprob": req.logprobs is not None, "top_logprobs_num": req.logprobs or 0}

    async def completion(self, req: CompletionRequest) -> dict:
        outs = await self.engine.async_generate(**self._completion_inputs(req))
        outs = outs if isinstance(outs, list) else [outs]
        choices = [{"index": i, "text": o["text"], "finish_reason": _finish_reason(o["meta_info"]),
                    "logprobs": self._completion_logprobs(o) if req.logprobs is not None else None}
                   for i, o in enumerate(outs)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": _usage(outs)}

    def _completion_logprobs(self, out: dict) -> dict:
        tok = self.engine.tokenizer
        entries = out["meta_info"].get("output_token_logprobs", [])
        tokens = [tok.decode([t]) if tok is not None else str(t) for _, t, _ in entries]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries]}

    async def completion_stream(self, req: CompletionRequest) -> AsyncIterator[str]:
        chunks = self.engine.async_generate(**self._completion_inputs(req), stream=True)
        async for line in self._stream(chunks, "cmpl", "text_completion", lambda delta: {"text": delta}):
            yield line

    # ---- chat ----------------------------------------------------------------------------------
    def _chat_inputs(self, req: ChatCompletionRequest) -> dict:
        from engine.tokenizer import apply_chat_template

        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat completions need a tokenizer; the engine was started without one")
        ids = apply_chat_template(tok, [m.model_dump() for m in req.messages])
        max_tokens = req.max_completion_tokens or req.max_tokens or 128
        return {"input_ids": ids, "sampling_params": openai_sampling_params(req, max_tokens),
                "return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs}

    async def chat(self, req: ChatCompletionRequest) -> dict:
        outs = await self.engine.async_generate(**self._chat_inputs(req))
        outs = outs if isinstance(outs, list) else [outs]
        choices = [{"index": i, "message": {"role": "assistant", "content": o["text"]},
                    "finish_reason": _finish_reason(o["meta_info"])} for i, o in enumerate(outs)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": _usage(outs)}

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        chunks = self.engine.async_generate(**self._chat_inputs(req), stream=True)
        as_delta = lambda delta: {"delta": {"role": "assistant", "content": delta}}  # noqa: E731
        async for line in self._stream(chunks, "chatcmpl", "chat.completion.chunk", as_delta):
            yield line

    async def _stream(self, chunks: AsyncIterator[dict], prefix: str, kind: str, shape) -> AsyncIterator[str]:
        """Cumulative engine chunks -> OpenAI SSE events carrying only the new text."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        sent: dict[int, int] = {}
        async for chunk in chunks:
            index = chunk.get("index", 0)
            delta = chunk["text"][sent.get(index, 0):]
            sent[index] = len(chunk["text"])
            choice = {"index": index, **shape(delta), "finish_reason": _finish_reason(chunk["meta_info"])}
            yield _sse({"id": rid, "object": kind, "created": int(time.time()),
                        "model": self.model_name, "choices": [choice]})
        yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
