"""What the soak's clients saw: one outcome per request (an HTTP status, or what went wrong),
counted by kind, and whether each is a failure. Every request runs under a timeout, so a request
the server never answers shows up as `stuck` instead of hanging the soak."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable

import httpx

REQUEST_TIMEOUT_S = 120.0  # far above any answer's time on the tiny model (pauses last <= 2 s)
# what the client saw when it is no HTTP status
DROPPED = "dropped"  # the client left on purpose (mid-stream, or before a non-streamed answer)
STUCK = "stuck"  # no answer within REQUEST_TIMEOUT_S
BROKEN = "broken_stream"  # a stream that ended without its [DONE]
TRANSPORT = "transport_error"  # connection refused / reset by the server
CLIENT_ERROR = "client_error"  # an answer the client could not read (bad JSON, wrong shape)
PARTLY_WRITTEN = "partly_written"  # a weight update that says it wrote part of the weights
ACCEPTED = "accepted"  # a malformed body that got a 2xx
MAX_NOTES = 40


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)  # (kind, outcome) -> n
    expected: dict[str, set] = field(default_factory=dict)  # kind -> statuses that are fine
    notes: list[str] = field(default_factory=list)  # the first failures, described
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)  # (tag, reason) -> n
    started: float = field(default_factory=time.monotonic)

    def record(self, kind: str, outcome: Any, note: str = "") -> None:
        self.counts[(kind, str(outcome))] += 1
        if self.is_failure(kind, str(outcome)) and len(self.notes) < MAX_NOTES:
            self.notes.append(f"{time.monotonic() - self.started:.1f}s {kind}: {outcome} {note}"[:400])

    def is_failure(self, kind: str, outcome: str) -> bool:
        if outcome == DROPPED:
            return False
        if not outcome.isdigit():
            return True
        status = int(outcome)
        if kind.startswith("malformed"):
            return not 400 <= status < 500
        return status not in self.expected.get(kind, {200})

    def failures(self) -> dict[str, int]:
        return {f"{kind} -> {outcome}": n for (kind, outcome), n in sorted(self.counts.items())
                if self.is_failure(kind, outcome)}

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.counts.items()):
            out.setdefault(kind, {})[outcome] = n
        return out

    def statuses(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for (_, outcome), n in self.counts.items():
            out[outcome] += n
        return dict(sorted(out.items()))

    async def guarded(self, kind: str, action: Awaitable[Any]) -> Any:
        """Run one request under the timeout and record what came of it (the action returns its
        outcome, or (outcome, note))."""
        try:
            result = await asyncio.wait_for(action, REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            result = (STUCK, f"no answer within {REQUEST_TIMEOUT_S:.0f} s")
        except httpx.TransportError as exc:
            result = (TRANSPORT, repr(exc))
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            result = (CLIENT_ERROR, repr(exc))
        outcome, note = result if isinstance(result, tuple) else (result, "")
        self.record(kind, outcome, note)
        return outcome
