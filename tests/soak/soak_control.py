"""The soak's control traffic (admin key): pause in each mode and continue, weight updates from
disk or from tensors (shared memory) alternating between two checkpoints, cache flushes, aborts (by rid, unknown rids, all), and
malformed bodies that must get a 4xx. One controller task runs these while the clients generate;
it tracks which checkpoint the server holds (every successful update flips it)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx

from soak_requests import Clients
from soak_tally import PARTLY_WRITTEN, Tally

PAUSE_MODES = ("abort", "retract", "in_place")
# A refused update (in_place KV that cannot be flushed, requests holding KV) and a flush while
# requests run are 400s by design: the reply and the state agree.
CONTROL_EXPECTED = {"update_weights": {200, 400}, "update_weights_tensor": {200, 400}, "flush_cache": {200, 400}}

MALFORMED: list[tuple[str, str, dict[str, Any]]] = [  # (name, path, httpx request kwargs)
    ("not_json", "/generate", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("ids_not_ints", "/generate", {"json": {"input_ids": "abc"}}),
    ("top_p_7", "/generate", {"json": {"text": "hi", "sampling_params": {"top_p": 7}}}),
    ("negative_tokens", "/generate", {"json": {"text": "hi", "sampling_params": {"max_new_tokens": -3}}}),
    ("oversized", "/generate", {"json": {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10 ** 7}}}),
    ("n_huge", "/generate", {"json": {"text": "hi", "sampling_params": {"n": 10 ** 6}}}),
    ("dup_rids", "/generate", {"json": {"input_ids": [[5], [6]], "rid": ["x", "x"]}}),
    ("chat_no_messages", "/v1/chat/completions", {"json": {"messages": "hi"}}),
    ("chat_stream_top_p_7", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "hi"}], "stream": True, "top_p": 7}}),
    ("chat_bad_role", "/v1/chat/completions", {"json": {"messages": [{"role": "robot", "content": "hi"}]}}),
    ("pause_bad_mode", "/pause_generation", {"json": {"mode": "sideways"}, "admin": True}),
    ("update_missing_dir", "/update_weights_from_disk", {"json": {"model_path": "/nonexistent/ckpt"}, "admin": True}),
    ("control_without_key", "/flush_cache", {"json": {}}),
    ("non_ascii_key", "/pause_generation", {"json": {}, "headers": {"authorization": "Bearer \u00e9t\u00e9".encode()}}),
]


class Controller:
    def __init__(self, clients: Clients, tally: Tally, checkpoints: tuple[str, str]) -> None:
        self.clients = clients
        self.tally = tally
        self.checkpoints = checkpoints
        self.current = 0  # index of the checkpoint the server holds
        self.version = 0
        self.version_name = ""  # the weight_version of the last update that landed
        tally.expected.update(CONTROL_EXPECTED)

    async def post(self, path: str, body: dict) -> Any:
        return await self.clients.http.post(path, json=body, headers=self.clients.admin)

    async def simple(self, path: str, body: dict) -> Any:
        resp = await self.post(path, body)
        return resp.status_code, resp.text[:200]

    async def update_weights(self, flush_cache: bool, from_tensor: bool = False) -> Any:
        """To the other checkpoint: from disk, or its tensors sent to /update_weights_from_tensor
        (shared memory, SGLang's serialized_named_tensors)."""
        target = 1 - self.current
        self.version += 1
        version = f"soak-{self.version}-{'ab'[target]}"
        if from_tensor:
            status, answer = await asyncio.to_thread(self._push_tensors, self.checkpoints[target], flush_cache,
                                                     version)
        else:
            body = {"model_path": self.checkpoints[target], "flush_cache": flush_cache, "weight_version": version}
            resp = await self.post("/update_weights_from_disk", body)
            status, answer = resp.status_code, resp.json()
        if "partly" in answer.get("message", ""):
            return PARTLY_WRITTEN, answer["message"]
        if status == 200 and answer.get("success"):
            self.current, self.version_name = target, version
        return status, answer.get("message", "")

    def _push_tensors(self, checkpoint: str, flush_cache: bool, version: str) -> tuple[int, dict]:
        from safetensors.torch import load_file

        from weight_sync.cuda_ipc import serialize

        named = [(name, tensor.share_memory_()) for path in sorted(Path(checkpoint).glob("*.safetensors"))
                 for name, tensor in load_file(str(path)).items()]
        body = {"serialized_named_tensors": [serialize(named, as_text=True)], "flush_cache": flush_cache,
                "weight_version": version}
        resp = httpx.post(self.clients.http.base_url.join("/update_weights_from_tensor"), json=body,
                          headers=self.clients.admin, timeout=120)
        return resp.status_code, resp.json()

    async def pause_cycle(self, rng: random.Random) -> None:
        """pause(mode) -> maybe update weights and/or flush -> continue (always)."""
        mode = rng.choice(PAUSE_MODES)
        await self.tally.guarded(f"pause_{mode}", self.simple("/pause_generation", {"mode": mode}))
        try:
            await asyncio.sleep(rng.uniform(0.1, 1.5))
            if rng.random() < 0.6:  # in_place keeps KV: a flushing update is refused, a non-flushing one lands
                flush = mode != "in_place" or rng.random() < 0.5
                kind, tensors = ("update_weights_tensor", True) if rng.random() < 0.4 else ("update_weights", False)
                await self.tally.guarded(kind, self.update_weights(flush, from_tensor=tensors))
            if rng.random() < 0.3:
                await self.tally.guarded("flush_cache", self.simple("/flush_cache", {}))
        finally:
            await self.tally.guarded("continue_generation", self.simple("/continue_generation", {}))

    async def abort_live(self, rng: random.Random) -> Any:
        rids = sorted(self.clients.live_rids)
        rid = rng.choice(rids) if rids else "soak-nobody"
        return await self.simple("/abort_request", {"rid": rid})

    async def malformed(self, rng: random.Random) -> None:
        name, path, spec = rng.choice(MALFORMED)
        spec = dict(spec)
        headers = dict(spec.pop("headers", {}))
        if spec.pop("admin", False):
            headers.update(self.clients.admin)

        async def send() -> Any:
            resp = await self.clients.http.post(path, headers=headers, **spec)
            return resp.status_code, resp.text[:200]

        await self.tally.guarded(f"malformed_{name}", send())

    async def step(self, rng: random.Random) -> None:
        """One random control action."""
        roll = rng.random()
        if roll < 0.30:
            await self.pause_cycle(rng)
        elif roll < 0.40:  # while generating: only a non-flushing update can land
            await self.tally.guarded("update_weights", self.update_weights(flush_cache=rng.random() < 0.3))
        elif roll < 0.52:
            await self.tally.guarded("flush_cache", self.simple("/flush_cache", {}))
        elif roll < 0.66:
            await self.tally.guarded("abort_request", self.abort_live(rng))
        elif roll < 0.68:
            await self.tally.guarded("abort_all", self.simple("/abort_request", {"abort_all": True}))
        else:
            await self.malformed(rng)

    async def run(self, rng: random.Random, stop_at: float, loop_time: Any) -> None:
        while loop_time() < stop_at:
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            await self.step(rng)
