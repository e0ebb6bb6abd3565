"""MatcherClient: the core's side of the grammar process (engine/grammar/matcher_server.py).

It stands where MaskPrefetch stands in the thread backend (start / take / drop / fill_now /
accept), and each request's grammar is a ProcessGrammar: a key into the process's matchers.
Per step the core only sends a message: the committed tokens and the rows to fill. Termination
needs no answer (a matcher ends only by accepting a stop token, and the mask allows one only
where the grammar may end); a refused token (possible only when the mask left nothing) comes
back with the step's reply and aborts its request at the next commit.

With a StreamGate (CUDA) the device waits for the process's fill on the shared gate word; the
core joins the process (all steps answered) before it reads the device again. A process that
dies, stops answering a step for `step_timeout_s` (--grammar-step-timeout; STARTUP_TIMEOUT_S until
it first answered) or cannot map its buffers is lost: the core opens the
gate itself (the device never hangs), the grammars it held refuse their next token (their
requests abort, naming why) and the next constrained request starts a new process. Without a
gate (CPU) `take` waits for the step's reply.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

from engine.grammar.compiler import DEFAULT_CACHE_BYTES
from engine.grammar.shared_ring import SharedBitmaskRing, SharedSegment
from engine.grammar.stream_gate import StreamGate

logger = logging.getLogger(__name__)

REPLY_POLL_S = 0.05
STARTUP_TIMEOUT_S = 120.0  # its first answer: imports and the first vocabulary index, on a loaded host
STEP_TIMEOUT_S = 15.0  # each later step (every row of the batch waits for it): --grammar-step-timeout
MIN_CAPACITY = 64


def grammar_backend_for(requested: str, device: torch.device) -> str:
    """"thread" or "process" for ServerArgs.grammar_backend. "auto": the process on a GPU when
    xgrammar is installed (without it the thread backend names the missing package to the first
    constrained request, and no process starts for nothing), else the thread."""
    if requested == "process" and not hasattr(os, "memfd_create"):
        raise ValueError("grammar_backend='process' needs Linux (its masks live in memfds); use 'thread'")
    if requested != "auto":
        return requested
    gpu = device.type == "cuda" and hasattr(os, "memfd_create")
    return "process" if gpu and importlib.util.find_spec("xgrammar") is not None else "thread"


class ProcessGrammar:
    """A request's matcher in the grammar process (the scheduler only sees it is not None)."""

    def __init__(self, client: "MatcherClient", key: int, generation: int, stop_ids: frozenset) -> None:
        self._client, self.key, self.generation = client, key, generation  # generation: which process holds it
        self.stop_ids = stop_ids
        self.refusal: Optional[str] = None  # why its last token was refused, when it was
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def __del__(self) -> None:  # the request is gone: its matcher can go
        self._client.freed.append(self.key)


class MatcherClient:
    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device, step_timeout_s: float = STEP_TIMEOUT_S,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.step_timeout_s, self._cache_bytes = step_timeout_s, cache_bytes
        self._answered = False  # this process answered a step: the start-up allowance is spent
        self._setup = (tokenizer_path, vocab_size, list(stop_token_ids))
        self.device = device
        self.ring = SharedBitmaskRing(vocab_size, device)
        self.gate: Optional[StreamGate] = None
        self.hand_off = True  # no meaning here (the thread backend's A/B knob)
        self.num_taken = 0
        self.freed: list[int] = []
        self._keys = itertools.count(1)
        self._generation = 0
        self._seq = 0
        self._done = 0  # the last step the process answered
        self._refused: dict[int, str] = {}
        self._accepts: list[tuple[int, int]] = []  # (key, token) not sent yet
        self._job: Optional[tuple[Any, int, torch.Tensor]] = None  # (batch, seq, bitmask) posted by start
        self._unanswered: list[tuple[int, torch.Tensor]] = []  # (seq, bitmask) of fills posted, not answered
        self._conn = self._process = None
        self._segment: Optional[SharedSegment] = None

    # ---- grammars ------------------------------------------------------------------------------
    def warm(self) -> None:
        """Start the process now (at engine start: its imports and vocabulary index run while
        the model loads, not when the first constrained request arrives)."""
        self._ensure_started()

    def new(self, kind: str, spec: str, stop_ids: Sequence[int]) -> ProcessGrammar:
        for _ in range(2):  # a process found dead is replaced once
            self._ensure_started()
            key = next(self._keys)
            if self._send(("new", key, kind, spec)):
                return ProcessGrammar(self, key, self._generation, frozenset(stop_ids))
        raise RuntimeError("the grammar process could not be started")

    def accept(self, grammars: Sequence[ProcessGrammar], tokens: Sequence[int]) -> list[bool]:
        """Queue each grammar's committed token for the process; False for a grammar that refused
        an earlier token or whose process was lost (its request aborts now)."""
        self._read_replies()
        out = []
        for grammar, token in zip(grammars, tokens):
            if grammar.generation != self._generation:  # nothing to send: no process holds its matcher
                grammar.refusal = "its grammar process was lost; constrained requests in it cannot continue"
                out.append(False)
                continue
            grammar.refusal = self._refused.get(grammar.key)
            ok = grammar.refusal is None
            if ok and token in grammar.stop_ids:
                grammar._terminated = True
            self._accepts.append((grammar.key, int(token)))
            out.append(ok)
        return out

    # ---- masks (MaskPrefetch's interface) ------------------------------------------------------
    def start(self, batch: Any, grammars: Sequence[Optional[ProcessGrammar]], ring: Any = None) -> None:
        self.drop()
        posted = self._post(grammars)
        if posted is not None:
            self._job = (batch, *posted)

    def take(self, batch: Any) -> Optional[torch.Tensor]:
        job, self._job = self._job, None
        if job is None or job[0] is not batch:
            return None
        self.num_taken += 1
        return self._ready(job[1], job[2])

    def fill_now(self, grammars: Sequence[Optional[ProcessGrammar]], ring: Any = None) -> Optional[torch.Tensor]:
        posted = self._post(grammars)
        return None if posted is None else self._ready(*posted)

    def drop(self) -> None:
        """Before the core reads the device: the process has answered every step it was sent."""
        self._job = None
        if self._conn is not None:
            self._wait_for(lambda: self._done == self._seq, "a step")

    def shutdown(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = self._job = None
        if process is not None:
            try:
                conn.send(("stop",))
            except OSError:
                pass
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(1)
        if self._segment is not None:
            self._segment.open_gate(self._seq)  # nothing is left to write it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no queued wait or copy reads the segment after this
            self.gate = None  # it holds a view of the segment
            self.ring.release()
            self._segment.close()
            self._segment = None

    # ---- inside --------------------------------------------------------------------------------
    def _post(self, grammars: Sequence[Optional[ProcessGrammar]]) -> Optional[tuple[int, torch.Tensor]]:
        """Send the queued accepts and, if a row is live, the fill of `grammars`' rows. None when
        nothing was filled (no live row, or the process was lost: every row then allows all)."""
        live = [(row, g.key) for row, g in enumerate(grammars)
                if g is not None and not g.is_terminated() and g.generation == self._generation]
        if not live and not self._accepts:
            return None
        self._ensure_started()
        if self.freed:
            freed, self.freed = self.freed, []
            for key in freed:
                self._refused.pop(key, None)
            if not self._send(("free", freed)):
                return None
        fill, bitmask = None, None
        if live:
            self._ensure_capacity(len(grammars))
            bitmask = self.ring.take(len(grammars))
            fill = (self.ring.slot_of(bitmask), len(grammars), [r for r, _ in live], [k for _, k in live])
        accepts, self._accepts = self._accepts, []
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        if not self._send(("step", self._seq, [k for k, _ in accepts], [t for _, t in accepts], fill)):
            return None
        if bitmask is None:
            return None
        self._unanswered.append((self._seq, bitmask))
        return self._seq, bitmask

    def _ready(self, seq: int, bitmask: torch.Tensor) -> torch.Tensor:
        """The bitmask once the device (gate) or this thread (no gate) has waited for its fill."""
        if self.gate is not None and self.gate.wait(seq):
            return bitmask
        self._wait_for(lambda: self._done == seq, "a step")  # lost: _lost made the rows allow everything
        return bitmask

    def _wait_for(self, condition: Callable[[], bool], what: str) -> bool:
        """Read replies until `condition` holds; False (the process lost) if it died or took
        longer than its timeout."""
        timeout_s = self.step_timeout_s if self._answered else STARTUP_TIMEOUT_S
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self._conn is None:
                return False
            if self._conn.poll(REPLY_POLL_S):
                self._read_replies()
            elif not self._process.is_alive():
                self._lost(f"it exited with code {self._process.exitcode}")
            elif time.monotonic() > deadline:
                self._lost(f"{what} took over {timeout_s:g} s (--grammar-step-timeout)")
        return True

    def _send(self, msg: tuple) -> bool:
        if self._conn is None:  # lost earlier in this step
            return False
        try:
            self._conn.send(msg)
            return True
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._lost("its pipe broke")
            return False

    def _read_replies(self) -> None:
        while self._conn is not None and self._conn.poll():
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                self._lost("its pipe closed")
                return
            if reply[0] == "done":
                self._done, self._answered = reply[1], True
                while self._unanswered and (self._done - self._unanswered[0][0]) & 0xFFFFFFFF < 1 << 31:
                    self._unanswered.pop(0)  # that fill is written (cyclic seq <= done)
                for key in reply[2]:
                    self._refused[key] = "the grammar refused the token sampled before this one"
            elif reply[0] == "refused":
                self._refused[reply[1]] = reply[2]
            else:
                logger.error("the grammar process reported: %s", reply[1])

    def _lost(self, why: str) -> None:
        """The device is let past every posted wait, the process's grammars refuse from now on,
        and the next constrained request starts a new process."""
        logger.error("the grammar process is lost (%s); its constrained requests abort", why)
        process = self._process
        if process is not None and process.is_alive():
            process.kill()
            process.join(1)
        for _, bitmask in self._unanswered:  # the device copies these once the gate opens: never stale rows
            bitmask.fill_(-1)
        self._unanswered = []
        if self._segment is not None:
            self._segment.open_gate(self._seq)
        self._process = self._conn = None
        self._answered = False
        self._accepts, self._job, self.freed = [], None, []
        self._done = self._seq
        self._generation += 1

    def _ensure_started(self) -> None:
        if self._process is not None:
            return
        from engine.grammar.server_process import ServerProcess

        path, vocab_size, stop_ids = self._setup
        setup = [os.fspath(path), int(vocab_size), [int(t) for t in stop_ids], int(self._cache_bytes)]
        self._process = ServerProcess("engine.grammar.matcher_server", setup)  # a fresh interpreter: never a fork of one holding CUDA
        self._conn = self._process.conn
        if self._segment is None:
            self._use(SharedSegment.create(MIN_CAPACITY, self._setup[1]))
        self._attach()
        self._send(("warm",))  # its vocabulary index comes before its first answer: the start-up allowance covers it

    def _ensure_capacity(self, rows: int) -> None:
        if self._segment.capacity >= rows:
            return
        capacity = MIN_CAPACITY
        while capacity < rows:
            capacity *= 2
        self.drop()  # the process has answered every step: it reads the old buffers no more
        old = self._segment
        self._use(SharedSegment.create(capacity, self._setup[1]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no queued wait or copy reads the old segment after this
        old.close()  # the process keeps its own mapping until it maps the new one
        if self._conn is not None:
            self._attach()

    def _use(self, segment: SharedSegment) -> None:
        """Make `segment` the ring's and the gate's, its word at the last sequence number posted."""
        segment.open_gate(self._seq)
        self.ring.use(segment)
        self._segment = segment
        self.gate = StreamGate.create(self.device, segment.word) if self.device.type == "cuda" and segment.register() else None

    def _attach(self) -> None:
        """Have the process map the current segment. No answer is awaited: a descriptor in flight
        keeps its memfd alive, so the core may close an older segment at once, and the process
        maps this one before it reads the next step (a failure to map ends it: lost)."""
        if self._send(("buffers", self._segment.label, self._segment.capacity)):
            self._send_fd(self._segment.fd)

    def _send_fd(self, fd: int) -> bool:
        """The segment's descriptor, right behind its "buffers" message (SCM_RIGHTS on the socket)."""
        from multiprocessing.reduction import send_handle

        try:
            send_handle(self._conn, fd, self._process.pid)
            return True
        except OSError:
            self._lost("its pipe broke")
            return False
