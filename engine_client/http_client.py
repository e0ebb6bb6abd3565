"""HttpClient: the EngineAPI over SGLang's HTTP routes (a `tandem serve` or SGLang server).

Bodies and replies are SGLang's (shared/reference/sglang-rl-api.md), so the same client drives
either server. Tensor updates send `weight_sync.cuda_ipc.serialize` payloads as base64 text in
`serialized_named_tensors` (one entry: one tensor-parallel rank): CUDA IPC handles on a GPU,
shared-memory descriptors on the CPU, so the server must be on this machine and the caller keeps
the tensors alive until the call returns. A refused request (400) comes back as (False, message)
for weight and memory verbs and as a ValueError for generate, as Engine raises one. A server that
is down, drops the connection or answers 503 raises EngineUnreachable, one that answers nothing
within timeout_s EngineTimeout, each naming the URL (engine_client/http_errors.py).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any, AsyncIterator, Optional

from engine.api.generate_request import GenerateRequest
from engine.api.protocol import DiskReply, Reply
from engine_client.http_errors import (Answer, EngineTimeout, generate_reply, json_or_none, message,
                                       transport_error)
from engine_client.request_slots import RequestSlots, aborted_reply

CONTROL_TIMEOUT_S = 600.0  # a weight update of a large model from disk can take minutes


class HttpClient:
    def __init__(self, base_url: str, api_key: Optional[str] = None, admin_api_key: Optional[str] = None,
                 timeout_s: Optional[float] = None, transport: Any = None, connect_timeout_s: float = 30.0,
                 max_connections: int = 1024) -> None:
        """api_key: the server's --api-key (generation and info routes); admin_api_key: its
        --admin-api-key, which opens every route (pause, weight updates, memory too). timeout_s:
        for one generate once sent (None waits as long as the request runs: the only bound on a
        server that accepts the connection and never answers); connect_timeout_s: for
        connecting; max_connections: async requests in flight at once, the rest wait their turn
        (request_slots.py); transport: an httpx transport for the synchronous verbs (tests)."""
        import httpx

        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        key = admin_api_key or api_key
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._sync = httpx.Client(base_url=self.base_url, headers=self._headers, transport=transport,
                                  timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=connect_timeout_s))
        self._slots = RequestSlots(max_connections)
        # an httpx.AsyncClient belongs to the event loop it first ran on: one per loop
        self._async: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Engine.generate's arguments (GenerateRequest's fields) -> its dicts."""
        import httpx

        body = generate_body(GenerateRequest.of(*args, **kwargs))
        timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        response = self._send("POST", "/generate", json=body, timeout=timeout)
        return generate_reply(response, f"POST {self.base_url}/generate")

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any:
        body = generate_body(GenerateRequest.of(*args, **kwargs))
        client = await self._async_client()
        async with self._slots.slot(body.get("rid")) as go:
            if not go:  # aborted while it waited for a connection: it never reached the server
                return aborted_reply(body)
            answer = Answer(*await client.post("/generate", body, timeout_s=self.timeout_s))
        return generate_reply(answer, f"POST {self.base_url}/generate")

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """Until /health answers 200 (a server still loading its model); EngineTimeout naming the
        URL and what it last said when that takes over timeout_s."""
        import httpx

        deadline, last = time.monotonic() + timeout_s, "no answer"
        while True:
            try:
                response = self._sync.get("/health", timeout=min(10.0, timeout_s))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise EngineTimeout(f"{self.base_url} was not ready after {timeout_s:g} s (its /health: {last})")
            time.sleep(poll_s)

    async def _async_client(self) -> Any:
        """This event loop's client (aiohttp when installed: engine_client/async_http.py), closed
        when the loop shuts down (asyncio.run), or by aclose()."""
        from engine_client.async_http import open_client

        loop = asyncio.get_running_loop()
        entry = self._async.get(loop)
        if entry is None:
            client = open_client(self.base_url, None, self._headers, self.connect_timeout_s)
            closer = _close_at_loop_shutdown(client)
            await closer.__anext__()  # the loop now holds it: shutdown_asyncgens() runs its finally
            entry = self._async[loop] = (client, closer)
        return entry[0]

    def abort_request(self, rid=None, abort_all=False, prefix=False):
        self._slots.abort(rid, abort_all, prefix)  # requests not sent yet too
        self._post("/abort_request", _abort_body(rid, abort_all, prefix))

    async def async_abort_request(self, rid=None, abort_all=False, prefix=False):
        self._slots.abort(rid, abort_all, prefix)
        client = await self._async_client()
        answer = Answer(*await client.post("/abort_request", _abort_body(rid, abort_all, prefix)))
        if answer.status_code != 200:
            raise RuntimeError(f"/abort_request failed with HTTP {answer.status_code}: {message(answer)}")

    def flush_cache(self):
        return self._send("POST", "/flush_cache").status_code == 200

    # ---- pause and weights ---------------------------------------------------------------------
    def pause_generation(self, mode="abort"):
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self):
        self._post("/continue_generation", {})

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
        """named_tensors: [(name, tensor)] or a flattened-bucket payload, serialized here; or
        payloads already serialized as text (one str, or one per rank)."""
        if isinstance(named_tensors, str):
            serialized = [named_tensors]
        elif isinstance(named_tensors, list) and named_tensors and all(isinstance(p, str) for p in named_tensors):
            serialized = named_tensors
        else:
            from weight_sync.cuda_ipc import serialize

            serialized = [serialize(named_tensors, as_text=True)]
        return self._reply("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "load_format": load_format, "flush_cache": flush_cache,
            "weight_version": weight_version})

    def update_weights_from_disk(self, model_path, load_format=None, weight_version=None, flush_cache=True
                                 ) -> DiskReply:
        """-> (success, message, num_paused_requests), as sglang.Engine's (the route's three fields)."""
        response = self._send("POST", "/update_weights_from_disk", json={
            "model_path": str(model_path), "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache})
        ok, text = self._reply_of(response)
        payload = json_or_none(response)
        paused = payload.get("num_paused_requests") if isinstance(payload, dict) else None
        return ok, text, paused if paused is not None else 0

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl", timeout_s=30.0):
        return self._reply("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend, "timeout_s": timeout_s})

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None, weight_version=None):
        return self._reply("/update_weights_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version, "load_format": load_format})

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        return self._reply("/destroy_weights_update_group", {"group_name": group_name})

    def release_memory_occupation(self, tags=None):
        return self._reply("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags=None):
        return self._reply("/resume_memory_occupation", {"tags": tags})

    # ---- LoRA adapters (SGLang's routes; replies {"success", "error_message", "loaded_adapters"}) ---
    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        return self._lora("/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path), "pinned": pinned})

    def unload_lora_adapter(self, lora_name):
        return self._lora("/unload_lora_adapter", {"lora_name": lora_name})

    def load_lora_adapter_from_tensors(self, lora_name, tensors=None, config_dict=None, load_format=None,
                                       pinned=False, serialized_tensors=None, expected_checksums=None):
        """tensors ({name: tensor}, pairs or a bucket payload) are serialized here; or pass base64
        text (weight_sync.cuda_ipc.serialize(as_text=True)) as tensors or serialized_tensors."""
        if serialized_tensors is None and isinstance(tensors, str):
            serialized_tensors = tensors
        if serialized_tensors is None:
            from weight_sync.cuda_ipc import serialize

            serialized_tensors = serialize(tensors, as_text=True)
        return self._lora("/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config_dict, "serialized_tensors": serialized_tensors,
            "load_format": load_format, "pinned": pinned, "expected_checksums": expected_checksums})

    def _lora(self, route, body):
        response = self._send("POST", route, json=body)
        payload = json_or_none(response)
        if response.status_code in (200, 400) and isinstance(payload, dict) and "success" in payload:
            return payload
        return {"success": False, "error_message": message(response), "loaded_adapters": None}

    def begin_weight_update(self, selector="all"):
        return self._reply("/begin_weight_update", {"selector": selector})

    def end_weight_update(self):
        return self._reply("/end_weight_update", {})

    # ---- state ---------------------------------------------------------------------------------
    def get_weight_version(self):
        """From /model_info (SGLang >= 0.5.9 answers /get_weight_version with 404)."""
        return self.get_model_info()["weight_version"]

    def get_model_info(self):
        response = self._send("GET", "/model_info")
        response.raise_for_status()
        return response.json()

    def health(self):
        import httpx

        try:
            return self._sync.get("/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def get_load(self):
        response = self._send("GET", "/get_load")
        response.raise_for_status()
        return response.json()

    def get_server_info(self):
        response = self._send("GET", "/get_server_info")
        if response.status_code == 404:  # SGLang's other spelling
            response = self._send("GET", "/server_info")
        response.raise_for_status()
        return response.json()

    def close(self):
        """Close the synchronous client and the async ones whose event loop is idle; await
        aclose() on a running loop for its own."""
        self._sync.close()
        for loop, (_, closer) in list(self._async.items()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(closer.aclose())
            self._async.pop(loop, None)

    async def aclose(self):
        entry = self._async.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    # ---- plumbing ------------------------------------------------------------------------------
    def _send(self, method: str, route: str, **kwargs: Any) -> Any:
        """The synchronous client's request; a transport failure names the URL."""
        import httpx

        try:
            return self._sync.request(method, route, **kwargs)
        except httpx.TransportError as exc:
            timeout = kwargs.get("timeout", self._sync.timeout)
            raise transport_error(f"{method} {self.base_url}{route}", exc, getattr(timeout, "read", timeout)) from exc

    def _post(self, route: str, body: dict) -> Any:
        """A verb without a (success, message) reply: a 400 is a ValueError, as Engine raises."""
        response = self._send("POST", route, json=body)
        if response.status_code == 400:
            raise ValueError(message(response))
        if response.status_code != 200:
            raise RuntimeError(f"{route} failed with HTTP {response.status_code}: {message(response)}")
        return response

    def _reply(self, route: str, body: dict) -> Reply:
        """SGLang's {"success", "message"} (200/400); memory routes answer 200 with `null`."""
        return self._reply_of(self._send("POST", route, json=body))

    @staticmethod
    def _reply_of(response: Any) -> Reply:
        payload = json_or_none(response)
        if isinstance(payload, dict) and "success" in payload:
            return bool(payload["success"]), str(payload.get("message", ""))
        if response.status_code == 200:
            return True, "Success"
        return False, message(response)


def _abort_body(rid: Any, abort_all: bool, prefix: bool) -> dict:
    """/abort_request's body; `prefix` (every rid starting with rid) only when set."""
    return {"rid": rid or "", "abort_all": abort_all, **({"prefix": True} if prefix else {})}


def generate_body(request: GenerateRequest) -> dict:
    """SGLang's /generate body: text (the prompt) or input_ids, sampling_params, the logprob
    options, and rid, logprob_distribution, token_ids_logprob, lora_path, extra_key,
    return_routed_experts (and its start), return_prompt_token_ids only when set (as SGLang's clients)."""
    if (request.prompt is None) == (request.input_ids is None):
        raise ValueError("give exactly one of prompt (text) and input_ids")
    if request.stream:
        raise ValueError("HttpClient answers with the final outputs; stream over /generate yourself")
    body: dict[str, Any] = {"text": request.prompt} if request.prompt is not None else {"input_ids": request.input_ids}
    body.update(sampling_params=request.sampling_params or {}, return_logprob=request.return_logprob,
                logprob_start_len=request.logprob_start_len, top_logprobs_num=request.top_logprobs_num)
    optional = {"rid": request.rid, "logprob_distribution": request.logprob_distribution,
                "token_ids_logprob": request.token_ids_logprob, "lora_path": request.lora_path,
                "extra_key": request.extra_key}
    body.update({name: value for name, value in optional.items() if value is not None})
    if request.return_routed_experts:  # only when asked: a server without the flag refuses it
        body["return_routed_experts"] = request.return_routed_experts
        if request.routed_experts_start_len:
            body["routed_experts_start_len"] = request.routed_experts_start_len
    if request.return_prompt_token_ids:
        body["return_prompt_token_ids"] = True
    return body


async def _close_at_loop_shutdown(client: Any) -> AsyncIterator[None]:
    """Suspended until its loop finalizes async generators (asyncio.run does on exit) or aclose():
    the client's connections close while their loop still runs."""
    try:
        yield
    finally:
        await client.close()
