"""GenerateStream: what async_generate returns; awaitable for final results, async-iterable
for cumulative streaming chunks (SGLang's shape: each chunk carries the text so far).

Unread outputs never pile up: each output of a request holds everything the ones before it did,
so only the newest one per request waits for the reader (a reader that falls behind gets the
latest chunk, as SGLang's tokenizer manager gives it). A stream whose reader is gone (`close`)
drops what arrives for it.

The engine holds a stream only weakly (`weak_sink`): a stream its caller dropped, e.g. left by
`break` from `async for` or a generate(stream=True) iterator never read, is collected, and the
request's next output finds its receiver gone (`ReceiverGone`), so the engine aborts it instead of
decoding on for nobody. A stream whose reader is waiting is held strongly (`_READING`) for as long as
it waits: asyncio keeps only weak references to tasks, so a task nobody holds, awaiting a stream,
would otherwise be collected with it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

from engine.core.messages import ReqInput, ReqOutput


_READING: set["GenerateStream"] = set()  # streams a reader awaits right now (on their event loop)


class ReceiverGone(Exception):
    """A request's output arrived after its reader dropped the stream: the engine aborts it."""


def weak_sink(owner: Any, put: Callable[[Any, ReqOutput], None]) -> Callable[[ReqOutput], None]:
    """A sink calling put(owner, out) while `owner` lives, without keeping it alive."""
    ref = weakref.ref(owner)

    def sink(out: ReqOutput) -> None:
        live = ref()
        if live is None:
            raise ReceiverGone(out.rid)
        put(live, out)
    return sink


class GenerateStream:
    def __init__(self, reqs: list[ReqInput], single: bool, stream: bool, loop: asyncio.AbstractEventLoop,
                 abort: Optional[Callable[[str, str], None]] = None):
        self.rids = [r.rid for r in reqs]
        self._abort = abort  # (rid, message): a cancelled await of the final results aborts what is left
        self._index = {rid: i for i, rid in enumerate(self.rids)}
        self.single = single
        self.stream = stream
        self.loop = loop
        self._unread: dict[str, ReqOutput] = {}  # the newest output of each request not yet read
        self._ready = asyncio.Event()
        self.pending = set(self.rids)
        self.finals: dict[str, dict] = {}
        self.closed = False

    def sink_for(self, rid: str) -> Callable[[ReqOutput], None]:
        return weak_sink(self, lambda stream, out: stream.loop.call_soon_threadsafe(stream._put, out))

    def _put(self, out: ReqOutput) -> None:
        if self.closed:
            return
        self._unread[out.rid] = out  # replaces an unread older one: this one carries it all
        self._ready.set()

    def unread_bytes(self) -> int:
        """About the JSON size of what waits for the reader (engine/server/stream_watch.py)."""
        return sum(json_size_estimate(out.output) for out in list(self._unread.values()))

    def close(self) -> None:
        """The reader is gone: free what waits and take nothing more."""
        self.closed = True
        self._unread.clear()
        self._ready.set()

    def __aiter__(self) -> "GenerateStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._unread:
            if not self.pending or self.closed:
                raise StopAsyncIteration
            self._ready.clear()
            _READING.add(self)
            try:
                await self._ready.wait()
            finally:
                _READING.discard(self)
        out = self._unread.pop(next(iter(self._unread)))
        if out.finished:
            self.pending.discard(out.rid)
            self.finals[out.rid] = out.output
        return _chunk(out, self.single, self._index)

    def __await__(self):
        """The final dict(s); with stream=True the stream itself, as sglang.Engine's
        `await async_generate(..., stream=True)` gives the async iterator of chunks."""
        return (self._self() if self.stream else self.collect()).__await__()

    async def _self(self) -> "GenerateStream":
        return self

    async def collect(self) -> Any:
        """The final dict(s), streaming or not (read to the end). Cancelled (asyncio.wait_for's
        timeout, a cancelled task), it aborts the requests not finished: nobody will read them, and
        a non-streamed request sends no output before its last to find its reader gone."""
        try:
            async for _ in self:
                pass
        except asyncio.CancelledError:
            if self._abort is not None:
                for rid in list(self.pending):
                    self._abort(rid, "its caller stopped waiting (the awaiting task was cancelled)")
            self.close()
            raise
        results = [self.finals[rid] for rid in self.rids]
        return results[0] if self.single else results


class SyncStream:
    """What generate(stream=True) returns, as sglang.Engine's: a plain iterator of cumulative
    chunks (batch chunks carry "index"). As GenerateStream, only the newest unread output per
    request is kept; closing the iterator early aborts what has not finished, and so does
    dropping it unread (its sink is weak)."""

    def __init__(self, reqs: list[ReqInput], single: bool, abort: Callable[[str, str], None]) -> None:
        self._index = {r.rid: i for i, r in enumerate(reqs)}
        self.single = single
        self._abort = abort
        self._unread: dict[str, ReqOutput] = {}
        self._ready = threading.Condition()

    def sink(self) -> Callable[[ReqOutput], None]:
        return weak_sink(self, SyncStream.put)

    def put(self, out: ReqOutput) -> None:
        with self._ready:
            self._unread[out.rid] = out  # replaces an unread older one: this one carries it all
            self._ready.notify()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pending = set(self._index)
        try:
            while pending:
                with self._ready:
                    self._ready.wait_for(lambda: self._unread)
                    out = self._unread.pop(next(iter(self._unread)))
                if out.finished:
                    pending.discard(out.rid)
                yield _chunk(out, self.single, self._index)
        finally:  # the caller stopped reading: nothing decodes for nobody
            for rid in pending:
                self._abort(rid, "stream closed by its reader")


def _chunk(out: ReqOutput, single: bool, index: dict[str, int]) -> dict[str, Any]:
    """A request's output as the caller sees it: a batch's carry their request's "index"."""
    return out.output if single else {"index": index[out.rid], **out.output}


LOGPROB_ROWS = ("output_token_logprobs", "input_token_logprobs")
LOGPROB_TABLES = ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs", "input_token_ids_logprobs")
ENTRY_BYTES = 32  # one [logprob, token id, null] in JSON
TOKEN_BYTES = 7


def json_size_estimate(output: dict) -> int:
    """An output's JSON size, cheaply: counts list lengths (the last position's width for a table),
    never walks entries."""
    meta = output.get("meta_info", {})
    entries = sum(len(meta.get(key) or ()) for key in LOGPROB_ROWS)
    for key in LOGPROB_TABLES:
        rows = meta.get(key) or ()
        entries += len(rows) * len(rows[-1] or ()) if rows else 0
    return (ENTRY_BYTES * entries + TOKEN_BYTES * len(output.get("output_ids", ())) + len(output.get("text", ""))
            + len(meta.get("routed_experts") or ""))  # base64 of [tokens, layers, top_k]
