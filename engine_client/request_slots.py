"""RequestSlots: at most `limit` of a client's requests in flight; the rest wait here.

Unbounded, a rollout batch of 2000 groups opened 2000 connections to one server at once (file
descriptors on both sides, and a server-side queue it cannot run any faster). A request waiting
here has not reached the server, so an abort by rid, or abort_all, would miss it there and it would
later run in full for nobody: the abort marks it here, and it answers as the server answers an
aborted request (finish_reason "abort", no tokens) without being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Optional

from engine.finish_reasons import abort_reason

ABORTED_HERE = "aborted before it was sent (it was waiting for one of HttpClient's max_connections)"


class RequestSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_connections must be >= 1, got {limit}")
        self.limit = limit
        self._semaphores: "weakref.WeakKeyDictionary[Any, asyncio.Semaphore]" = weakref.WeakKeyDictionary()
        self._waiting: dict[int, tuple[Optional[str], list[bool]]] = {}  # ticket -> (rid, [aborted])
        self._tickets = itertools.count()
        self._lock = threading.Lock()  # abort_request may come from another thread

    @contextlib.asynccontextmanager
    async def slot(self, rid: Any) -> AsyncIterator[bool]:
        """Holds a slot while the request runs -> False when it was aborted while it waited."""
        loop = asyncio.get_running_loop()  # a semaphore belongs to one event loop
        semaphore = self._semaphores.get(loop) or self._semaphores.setdefault(loop, asyncio.Semaphore(self.limit))
        ticket, flag = next(self._tickets), [False]
        with self._lock:
            self._waiting[ticket] = (rid if isinstance(rid, str) else None, flag)
        try:
            async with semaphore:
                with self._lock:
                    self._waiting.pop(ticket, None)
                yield not flag[0]
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)

    def abort(self, rid: Optional[str], abort_all: bool, prefix: bool = False) -> None:
        """Marks the waiting requests an abort names: its rid, or a request whose sample it names
        (the engine's rid for sample i of a request with n is "{rid}-{i}"); with `prefix`, every
        request whose rid starts with rid."""
        with self._lock:
            for request_rid, flag in self._waiting.values():
                if request_rid is None or not rid:
                    named = False
                else:
                    named = request_rid.startswith(rid) if prefix else _names(rid, request_rid)
                if abort_all or named:
                    flag[0] = True


def _names(aborted: str, request_rid: str) -> bool:
    head, _, tail = aborted.rpartition("-")
    return aborted == request_rid or (head == request_rid and tail.isdigit())


def aborted_reply(body: dict) -> Any:
    """What the server answers for a request aborted before it ran: one output per sample."""
    prompts = body["input_ids"] if "input_ids" in body else body["text"]
    if "input_ids" in body:
        single = not prompts or not isinstance(prompts[0], list)  # one prompt's ids, or a batch of them
    else:
        single = isinstance(prompts, str)
    n = int((body.get("sampling_params") or {}).get("n", 1))
    count = (1 if single else len(prompts)) * n
    outputs = [{"text": "", "output_ids": [], "meta_info": {
        "id": body.get("rid"), "finish_reason": abort_reason(ABORTED_HERE), "prompt_tokens": 0, "completion_tokens": 0,
        "cached_tokens": 0, "output_token_logprobs": [], "weight_versions": []}} for _ in range(count)]
    return outputs[0] if count == 1 and single else outputs
