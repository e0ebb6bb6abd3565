"""GenerateStream: what async_generate returns; awaitable for final results, async-iterable
for cumulative streaming chunks (SGLang's shape: each chunk carries the text so far)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from engine.core.messages import ReqOutput
from engine.core.messages import ReqInput


class GenerateStream:
    def __init__(self, reqs: list[ReqInput], single: bool, stream: bool, loop: asyncio.AbstractEventLoop):
        self.rids = [r.rid for r in reqs]
        self.single = single
        self.stream = stream
        self.loop = loop
        self.queue: "asyncio.Queue[ReqOutput]" = asyncio.Queue()
        self.pending = set(self.rids)
        self.finals: dict[str, dict] = {}

    def sink_for(self, rid: str) -> Callable[[ReqOutput], None]:
        return lambda out: self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def __aiter__(self) -> "GenerateStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.pending:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out.finished:
            self.pending.discard(out.rid)
            self.finals[out.rid] = out.output
        return out.output if self.single else {"index": self.rids.index(out.rid), **out.output}

    def __await__(self):
        return self._collect().__await__()

    async def _collect(self) -> Any:
        async for _ in self:
            pass
        results = [self.finals[rid] for rid in self.rids]
        return results[0] if self.single else results
