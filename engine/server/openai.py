"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of Engine.async_generate.

`*_request` turns a body into the engine's GenerateRequest; `*_response` shapes the final
outputs; `*_events` turns the cumulative engine chunks into OpenAI SSE events. Choices are prompt-major:
index = prompt * n + sample, as in SGLang.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Optional

from engine.api.generate_request import GenerateRequest
from engine.api.request_ids import fresh_rid
from engine.server import forced_tool_calls
from engine.server.parsed_reply import ReplyParsers
from engine.server.chat_messages import check_nesting, template_messages
from engine.server.openai_logprobs import (chat_logprobs, completion_logprobs, echo_entries, logprob_texts,
                                           output_entries, token_decoder)
from engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest, openai_sampling_params
from engine.server.sse import sse_event
from engine.server.template_content import template_content_format
from engine.server.token_bytes import token_bytes


def _finish_reason(meta: dict) -> Optional[str]:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def _matched_stop(meta: dict) -> Any:
    """SGLang's matched_stop: the stop string or token id that ended the choice (None otherwise)."""
    return (meta.get("finish_reason") or {}).get("matched")


def usage(metas: list[dict], n: int, cache_report: bool = False) -> dict:
    """Each prompt counted once (outputs are prompt-major, n per prompt); with --enable-cache-report
    SGLang's prompt_tokens_details: the cached prompt tokens of every choice."""
    prompt = sum(m["prompt_tokens"] for m in metas[::max(n, 1)])
    completion = sum(m["completion_tokens"] for m in metas)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cache_report:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(m.get("cached_tokens", 0) for m in metas)}
    return counts


def _metadata(meta: dict, metadata_format: str) -> dict:
    """SGLang's response metadata: the weights that produced choice 0. "spans": 0.5.23's, with the
    per-token spans; "weight_version": 0.5.6's, strings only (the openai package's Dict[str, str])."""
    if metadata_format == "weight_version":
        return {"weight_version": str(meta.get("weight_version"))}
    return {"weight_version": meta.get("weight_version"), "weight_versions": meta.get("weight_versions")}


class OpenAIServing:
    def __init__(self, engine: Any, model_name: str, sampling_defaults: Optional[dict] = None,
                 metadata_format: str = "spans"):
        self.engine = engine
        self.metadata_format = metadata_format
        self.model_name = model_name
        self.sampling_defaults = sampling_defaults or {}  # the model's, for fields a chat request leaves unset
        self.decode = token_decoder(engine.tokenizer)
        self.token_bytes = token_bytes(engine.tokenizer)  # chat logprobs' bytes: each token's own
        self.trust_request_chat_template = engine.server_args.trust_request_chat_template
        self.lora_enabled = engine.server_args.enable_lora
        self.tool_call_parser = engine.server_args.tool_call_parser
        self.reasoning_parser = engine.server_args.reasoning_parser
        self.cache_report = engine.server_args.enable_cache_report

    # ---- completions ---------------------------------------------------------------------------
    def completion_request(self, req: CompletionRequest) -> GenerateRequest:
        prompt = req.prompt
        key = "input_ids" if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str) else "prompt"
        if req.return_token_ids:  # tokenized here, so the reply can carry the ids the engine ran
            text, ids = (prompt, None) if key == "prompt" else (None, prompt)
            req._prompt_ids, single = self.engine.builder.prompts.token_lists(text, ids)
            key, prompt = "input_ids", req._prompt_ids[0] if single else req._prompt_ids
        wants_logprobs = req.logprobs is not None
        return GenerateRequest(
            **{key: prompt}, sampling_params=openai_sampling_params(req, req.max_tokens),
            return_logprob=wants_logprobs, logprob_start_len=0 if req.echo and wants_logprobs else -1,
            top_logprobs_num=req.logprobs or 0, rid=req.rid, stream=req.stream,
            return_routed_experts=req.return_routed_experts, lora_path=req.adapter(self.lora_enabled),
            routed_experts_start_len=req.routed_experts_start_len or 0, extra_key=req.cache_key())

    def _prompt_texts(self, req: CompletionRequest) -> list[str]:
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return list(prompt)
        lists = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        tok = self.engine.tokenizer
        return [tok.decode(ids) if tok is not None else "" for ids in lists]

    def completion_response(self, req: CompletionRequest, outs: Any) -> dict:
        outs = outs if isinstance(outs, list) else [outs]
        prompts = self._prompt_texts(req) if req.echo else []
        choices = []
        for i, o in enumerate(outs):
            meta, head = o["meta_info"], prompts[i // req.n] if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                entries, tops = echo_entries(meta) if req.echo else output_entries(meta)
                logprobs = completion_logprobs(entries, tops, self.decode)
            choice = {"index": i, "text": head + o["text"], "logprobs": logprobs,
                      "finish_reason": _finish_reason(meta), "matched_stop": _matched_stop(meta)}
            if req.return_token_ids:
                choice.update(token_ids=o["output_ids"], prompt_token_ids=req._prompt_ids[i // req.n])
            choices.append(choice)
        metas = [o["meta_info"] for o in outs]
        reply_id = _reply_id(metas[0], f"cmpl-{fresh_rid()}")
        return {"id": reply_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage(metas, req.n, self.cache_report),
                "metadata": _metadata(metas[0], self.metadata_format), **_sglext(req, metas)}

    def completion_events(self, req: CompletionRequest, stream: Any) -> AsyncIterator[str]:
        prompts = self._prompt_texts(req) if req.echo else []
        next_offset: dict[int, int] = {}  # per choice: where its next token's text_offset starts

        def delta(index: int, text: str, chunk: dict, sent_tokens: int, first: bool) -> dict:
            head = prompts[index // req.n] if req.echo and first else ""
            choice: dict = {"text": head + text}
            if req.logprobs is not None:  # as the whole reply's: the echoed prompt's entries first, and
                # text_offset running on over the tokens' texts as the whole reply counts it
                meta = chunk["meta_info"]
                entries = echo_entries(meta) if req.echo and first else output_entries(meta, sent_tokens)
                logprobs = completion_logprobs(*entries, self.decode, offset=next_offset.get(index, 0))
                if logprobs["tokens"]:
                    next_offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                choice["logprobs"] = logprobs
            if req.return_token_ids:  # the new ids of this chunk; the prompt's with the first
                choice["token_ids"] = chunk["output_ids"][sent_tokens:]
                if first:
                    choice["prompt_token_ids"] = req._prompt_ids[index // req.n]
            return choice

        return self._events(stream, req, "cmpl", "text_completion", delta)

    # ---- chat ----------------------------------------------------------------------------------
    def chat_request(self, req: ChatCompletionRequest) -> GenerateRequest:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat completions need a tokenizer; the engine was started without one")
        if req.brings_template() and not self.trust_request_chat_template:
            raise ValueError("this request brings its own chat_template, which the server does not run: start it "
                             "with --trust-request-chat-template to allow request-supplied templates")
        params = openai_sampling_params(req, _chat_max_tokens(req), self.sampling_defaults)
        tools = req.template_tools()
        if tools:  # SGLang keeps special tokens when tools are offered: tool-call markers stay in the text
            params["skip_special_tokens"] = False
        schema = forced_tool_calls.forced_call_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
        req._forced_calls = forced_tool_calls.constrain(params, schema)
        if req.input_ids is not None:  # the client's own rendering: no template
            ids = list(req.input_ids)
        else:
            ids = _chat_prompt_ids(tok, req, tools, self.engine.builder.prompt_size.check)
        req._prompt_ids = ids
        return GenerateRequest(
            input_ids=ids, sampling_params=params,
            return_logprob=req.logprobs, top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
            rid=req.rid, stream=req.stream, return_routed_experts=req.return_routed_experts,
            lora_path=req.adapter(self.lora_enabled), routed_experts_start_len=req.routed_experts_start_len or 0,
            extra_key=req.cache_key())

    def chat_response(self, req: ChatCompletionRequest, outs: Any) -> dict:
        outs = outs if isinstance(outs, list) else [outs]
        choices, parsers = [], ReplyParsers(self.reasoning_parser, self.tool_call_parser, req)
        for i, o in enumerate(outs):
            meta = o["meta_info"]
            logprobs = chat_logprobs(*output_entries(meta), self.decode, self.token_bytes) if req.logprobs else None
            # SGLang's ChatMessage always has these keys (null but under the parsers)
            message = {"role": "assistant", "content": o["text"], "reasoning_content": None, "tool_calls": None}
            choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(meta),
                      "matched_stop": _matched_stop(meta)}
            if req._forced_calls:
                choice["finish_reason"] = forced_tool_calls.as_tool_calls(message, o["text"], choice["finish_reason"])
            elif parsers:
                choice["finish_reason"] = parsers.fill(message, o["text"], choice["finish_reason"])
            if choice["finish_reason"] == "tool_calls":  # SGLang: no stop matched a call
                choice["matched_stop"] = None
            choices.append(self._token_outputs(req, o, choice))
        metas = [o["meta_info"] for o in outs]
        reply_id = _reply_id(metas[0], f"chatcmpl-{fresh_rid()}")
        return {"id": reply_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage(metas, req.n, self.cache_report),
                "metadata": _metadata(metas[0], self.metadata_format), **_sglext(req, metas)}

    def _token_outputs(self, req: ChatCompletionRequest, out: dict, choice: dict) -> dict:
        """SGLang's extra choice fields, when asked: prompt_token_ids, token_ids (the output's ids)
        and meta_info (the engine's, logprob entries with their texts, as SGLang's chat sends them)."""
        if req.return_prompt_token_ids or req.return_token_ids:
            choice["prompt_token_ids"] = req._prompt_ids
        if req.return_token_ids:
            choice["token_ids"] = out["output_ids"]
        if req.return_meta_info:
            choice["meta_info"] = logprob_texts(out, self.decode)["meta_info"]
        return choice

    def chat_events(self, req: ChatCompletionRequest, stream: Any) -> AsyncIterator[str]:
        parsers = ReplyParsers(self.reasoning_parser, self.tool_call_parser, req)
        parsed = parsers.stream() if parsers else None

        def delta(index: int, text: str, chunk: dict, sent_tokens: int, first: bool) -> Optional[dict]:
            extra, reason = {}, None
            if parsed is not None:  # thinking and content as they come; tool calls at the end
                text, extra, reason = parsed.delta(index, chunk["text"], _finish_reason(chunk["meta_info"]))
            message = {"role": "assistant", "content": text} if first else {"content": text}
            message.update(extra)
            choice: dict = {"delta": message}
            if reason is not None:
                choice["finish_reason"] = reason
            elif parsed is not None and not text and not extra and not first and not req.logprobs:
                return None  # held back: nothing to send yet
            if req._forced_calls:  # the calls in one delta once the array is whole; no content before
                message["content"] = None
                reason = _finish_reason(chunk["meta_info"])
                if reason is not None:
                    choice["finish_reason"] = forced_tool_calls.as_tool_calls(message, chunk["text"], reason)
                elif not first and not req.logprobs:
                    return None  # an empty delta: nothing to send while the array grows
            if req.logprobs:
                choice["logprobs"] = chat_logprobs(*output_entries(chunk["meta_info"], sent_tokens), self.decode,
                                                   self.token_bytes)
            return choice

        return self._events(stream, req, "chatcmpl", "chat.completion.chunk", delta)

    # ---- streaming -----------------------------------------------------------------------------
    async def _events(self, chunks: Any, req: Any, prefix: str, kind: str,
                      delta: Callable[[int, str, dict, int, bool], Optional[dict]]) -> AsyncIterator[str]:
        """Cumulative engine chunks -> one event per chunk with only what is new (none where `delta`
        has nothing to send); then, with stream_options.include_usage, a usage event with no choices
        (and with continuous_usage_stats, each chunk's choice's usage so far); then [DONE]."""
        unnamed, created = f"{prefix}-{fresh_rid()}", int(time.time())
        rid = unnamed  # each chunk's id is its request's rid; the closing chunks take the last one
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, dict] = {}
        async for chunk in chunks:
            index, meta = chunk.get("index", 0), chunk["meta_info"]
            rid = _reply_id(meta, unnamed)
            first = index not in sent_chars
            text = chunk["text"][sent_chars.get(index, 0):]
            new = delta(index, text, chunk, sent_tokens.get(index, 0), first)
            sent_chars[index], sent_tokens[index] = len(chunk["text"]), len(chunk["output_ids"])
            if new is None:
                continue
            choice = {"index": index, "finish_reason": _finish_reason(meta), **new}  # (a delta may name its own)
            if choice["finish_reason"] is not None:
                choice["matched_stop"] = None if choice["finish_reason"] == "tool_calls" else _matched_stop(meta)
                finals[index] = meta
            event = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if req.continuous_usage:  # SGLang's: this choice's counts so far, on every chunk
                event["usage"] = usage([meta], 1, self.cache_report)
            yield sse_event(event)
        metas = [finals[i] for i in sorted(finals)]
        ext = _sglext(req, metas)
        if ext:  # SGLang: its own chunk, with no choices, before the usage chunk
            yield sse_event({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [], **ext})
        if req.include_usage:
            yield sse_event({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                        "usage": usage(metas, req.n, self.cache_report)})
        yield "data: [DONE]\n\n"


def _sglext(req: Any, metas: list[dict]) -> dict:
    """SGLang's response-level extension: the first choice's routed experts, when asked for."""
    routes = next((m.get("routed_experts") for m in metas if m.get("routed_experts") is not None), None)
    return {"sglext": {"routed_experts": routes}} if req.return_routed_experts and routes is not None else {}


def _chat_max_tokens(req: ChatCompletionRequest) -> Optional[int]:
    """None when neither is set: SGLang's chat then generates up to the context length (an agent's
    long turn is not cut at a default)."""
    return next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), None)  # 0 is 0


def _chat_prompt_ids(tok: Any, req: ChatCompletionRequest, tools: Optional[list[dict]],
                     check: Callable[[str, str], None]) -> list[int]:
    """The template's prompt, as SGLang renders it: tools as sent, else (a template that wants
    them flat) each tool's function; with continue_final_message the last assistant message's
    text is the start of the reply. What the template gets is checked for nesting first, and the
    rendered text by `check` (its size) before it is tokenized."""
    from engine.tokenizer import apply_chat_template

    kwargs = req.template_kwargs()
    messages, prefix = template_messages(req.messages, template_content_format(tok, kwargs), req.continue_final_message)
    for value, what in ((messages, "messages"), (tools, "tools"), (kwargs, "chat_template_kwargs")):
        check_nesting(value, what)
    render = lambda t: apply_chat_template(tok, messages, assistant_prefix=prefix or "", check=check,  # noqa: E731
                                           tools=t, **kwargs)
    try:
        return render(tools)
    except ValueError:
        if not tools:
            raise
        return render([t.get("function", t) for t in tools])


def _reply_id(meta: dict, unnamed: str) -> str:
    """A reply's id is its request's rid, as SGLang's (meta_info["id"]): what /abort_request takes.
    With n > 1 or several prompts each choice is a request of its own: the reply carries the first
    one's rid and each stream chunk its own choice's (SGLang's too; OpenAI's has one id a stream)."""
    return str(meta.get("id") or unnamed)
