"""The soak's generation requests: /generate and /v1/chat/completions, streamed or not, with
random sampling parameters (n > 1, logprobs, penalties, seeds, stops), some under a regex (their
output checked), some left mid-way on purpose, some aborted by rid. Each returns its outcome for Tally.guarded."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from soak_tally import BROKEN, DROPPED

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away", "rollout", "reward",
         "policy", "token", "seven", "blue", "quick", "why", "42", "!", "?", "\n")
STREAM_DONE = "data: [DONE]"


@dataclass
class Clients:
    """What every request needs: the HTTP client, the admin header, and the rids in flight (the
    controller aborts some of them)."""
    http: httpx.AsyncClient
    admin: dict[str, str]
    live_rids: set[str] = field(default_factory=set)
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)  # (tag, reason) -> n

    def note_finish(self, tag: str, path: str, answer: Any) -> None:
        for reason in finish_reasons(path, answer):
            self.finish_reasons[(tag, reason)] += 1


def random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))


def random_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(rng.randint(1, 120))]


def random_sampling(rng: random.Random) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": rng.randint(1, 96), "temperature": rng.choice([0.0, 0.3, 0.7, 1.0, 1.3]),
        "top_p": rng.choice([1.0, 0.9, 0.5]), "top_k": rng.choice([-1, 1, 5, 50]), "min_p": rng.choice([0.0, 0.05]),
        "ignore_eos": rng.random() < 0.5, "n": rng.choice([1, 1, 1, 2, 4]),
    }
    if rng.random() < 0.3:
        params.update(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)
    if rng.random() < 0.3:
        params["sampling_seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.2:
        params["stop"] = rng.choice(WORDS[:8])
    return params


def generate_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    params = random_sampling(rng)
    body: dict[str, Any] = {"sampling_params": params, "stream": stream}
    if rng.random() < 0.5:
        body["text"] = random_text(rng)
    elif rng.random() < 0.2 and params["n"] == 1:  # a batch of prompts
        body["input_ids"] = [random_ids(rng) for _ in range(rng.randint(2, 3))]
    else:
        body["input_ids"] = random_ids(rng)
    if rng.random() < 0.3:
        body.update(return_logprob=True, top_logprobs_num=rng.choice([0, 1, 5]))
    return body


def chat_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": random_text(rng)}], "stream": stream,
        "max_tokens": rng.randint(1, 96), "temperature": rng.choice([0.0, 0.5, 1.0]),
        "top_p": rng.choice([1.0, 0.9]), "n": rng.choice([1, 1, 2, 3]), "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.4:
        body.update(logprobs=True, top_logprobs=rng.choice([0, 2, 5]))
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["seed"] = rng.randrange(1 << 30)
    return body


async def post_or_drop(clients: Clients, path: str, body: dict, rng: random.Random, drop: bool,
                       tag: str = "answered") -> Any:
    """A non-streamed request; with `drop` the client gives up after a random short wait."""
    if drop:
        try:
            resp = await asyncio.wait_for(clients.http.post(path, json=body), rng.uniform(0.02, 0.5))
        except asyncio.TimeoutError:
            return DROPPED
    else:
        resp = await clients.http.post(path, json=body)
    if resp.status_code != 200:
        return resp.status_code, resp.text[:200]
    answer = resp.json()
    clients.note_finish(tag, path, answer)
    return resp.status_code


def finished_part(path: str, chunk: dict) -> Any:
    """What of a streamed chunk has finished (a request's last chunk carries its finish reason)."""
    if path == "/generate":
        return [chunk] if chunk["meta_info"].get("finish_reason") else []
    return {"choices": [c for c in chunk.get("choices", []) if c.get("finish_reason")]}


def finish_reasons(path: str, answer: Any) -> list[str]:
    """The finish reasons of a final answer or a stream's last chunk; checks the shape a client
    relies on (raises for Tally's client_error)."""
    if path == "/generate":
        outs = answer if isinstance(answer, list) else [answer]
        assert all(isinstance(out["output_ids"], list) for out in outs)
        reasons = [out["meta_info"]["finish_reason"]["type"] for out in outs]
        assert set(reasons) <= {"length", "stop", "abort"}, reasons
        return reasons
    choices = answer["choices"]
    assert all("finish_reason" in c for c in choices)
    return [str(c["finish_reason"]) for c in choices]


async def stream_or_drop(clients: Clients, path: str, body: dict, rng: random.Random, drop: bool,
                         tag: str = "answered") -> Any:
    """A streamed request read to its [DONE], or left after a few chunks with `drop`."""
    leave_after = rng.randint(1, 8) if drop else None
    chunks = 0
    async with clients.http.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, (await resp.aread())[:200].decode(errors="replace")
        async for line in resp.aiter_lines():
            if line == STREAM_DONE:
                return resp.status_code
            if line.startswith("data: "):
                clients.note_finish(tag, path, finished_part(path, json.loads(line[6:])))
                chunks += 1
                if chunks == leave_after:
                    return DROPPED
    return BROKEN, f"after {chunks} chunks"


async def generate(clients: Clients, rng: random.Random, stream: bool = False, drop: bool = False) -> Any:
    body = generate_body(rng, stream)
    if stream:
        return await stream_or_drop(clients, "/generate", body, rng, drop)
    return await post_or_drop(clients, "/generate", body, rng, drop)


async def chat(clients: Clients, rng: random.Random, stream: bool = False, drop: bool = False) -> Any:
    body = chat_body(rng, stream)
    if stream:
        return await stream_or_drop(clients, "/v1/chat/completions", body, rng, drop)
    return await post_or_drop(clients, "/v1/chat/completions", body, rng, drop)


async def generate_then_abort(clients: Clients, rng: random.Random) -> Any:
    """A long request under its own rid, aborted through /abort_request after a random wait: the
    client still gets its answer (finish_reason abort, or length if it got there first)."""
    rid = f"soak-{uuid.uuid4().hex}"
    body = {"input_ids": random_ids(rng), "rid": rid, "stream": rng.random() < 0.5,
            "sampling_params": {"max_new_tokens": rng.randint(200, 1500), "ignore_eos": True,
                                "temperature": rng.choice([0.0, 1.0])}}
    clients.live_rids.add(rid)

    async def abort_later() -> None:
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        resp = await clients.http.post("/abort_request", json={"rid": rid}, headers=clients.admin)
        assert resp.status_code == 200, resp.status_code

    aborter = asyncio.ensure_future(abort_later())
    try:
        if body["stream"]:
            return await stream_or_drop(clients, "/generate", body, rng, drop=False, tag="aborted_by_rid")
        return await post_or_drop(clients, "/generate", body, rng, drop=False, tag="aborted_by_rid")
    finally:
        clients.live_rids.discard(rid)
        await aborter


async def generate_constrained(clients: Clients, rng: random.Random) -> Any:
    """/generate under a regex: a few patterns recur (cached), a fresh one now and then (a
    compile while the load runs). A request that stopped must match its pattern in full."""
    pattern = f"[0-9]{{{rng.randint(1, 3 if rng.random() < 0.8 else 40)}}}-(yes|no|[a-z]{{2}})"
    body = {"text": random_text(rng), "sampling_params": {
        "max_new_tokens": 64, "temperature": rng.choice([0.0, 1.0]), "n": rng.choice([1, 1, 2]), "regex": pattern}}
    resp = await clients.http.post("/generate", json=body)
    if resp.status_code != 200:
        return resp.status_code, resp.text[:200]
    answer = resp.json()
    for out in answer if isinstance(answer, list) else [answer]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
    clients.note_finish("constrained", "/generate", answer)
    return resp.status_code


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"enum": ["yes", "no"]}},
          "required": ["n", "ok"], "additionalProperties": False}


async def generate_json_schema(clients: Clients, rng: random.Random) -> Any:
    """/generate under a JSON schema (one that recurs, so the cache serves it after the first
    compile, or a fresh variant now and then): an output that stopped parses and fits it."""
    schema = SCHEMA if rng.random() < 0.8 else {**SCHEMA, "title": f"t{rng.randint(0, 10**6)}"}
    body = {"text": random_text(rng), "sampling_params": {
        "max_new_tokens": 48, "temperature": rng.choice([0.0, 1.0]), "json_schema": json.dumps(schema)}}
    resp = await clients.http.post("/generate", json=body)
    if resp.status_code != 200:
        return resp.status_code, resp.text[:200]
    out = resp.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        value = json.loads(out["text"])
        assert set(value) == {"n", "ok"} and value["ok"] in ("yes", "no"), out["text"]
    clients.note_finish("constrained", "/generate", out)
    return resp.status_code


async def malformed_grammar(clients: Clients, rng: random.Random) -> Any:
    """A grammar that cannot compile: a 400 naming it, before anything runs."""
    kind, spec = rng.choice([("regex", "[0-9"), ("json_schema", "{not json"), ("ebnf", "root ::= ")])
    resp = await clients.http.post("/generate", json={"text": "hi", "sampling_params": {kind: spec}})
    return resp.status_code


def generation_mix() -> list[tuple[str, int, Any]]:
    """(kind, weight, action(clients, rng)) for the client loops."""
    return [
        ("generate", 20, lambda c, r: generate(c, r)),
        ("generate_stream", 14, lambda c, r: generate(c, r, stream=True)),
        ("generate_stream_left", 8, lambda c, r: generate(c, r, stream=True, drop=True)),
        ("generate_left", 5, lambda c, r: generate(c, r, drop=True)),
        ("chat", 12, lambda c, r: chat(c, r)),
        ("chat_stream", 10, lambda c, r: chat(c, r, stream=True)),
        ("chat_stream_left", 5, lambda c, r: chat(c, r, stream=True, drop=True)),
        ("chat_left", 3, lambda c, r: chat(c, r, drop=True)),
        ("generate_aborted_by_rid", 5, generate_then_abort),
        ("generate_constrained", 6, generate_constrained),
        ("generate_json_schema", 4, generate_json_schema),
        ("malformed_grammar", 1, malformed_grammar),
    ]
