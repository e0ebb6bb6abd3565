"""MatcherClient: the core's side of the grammar process (engine/grammar/matcher_server.py).

It stands where MaskPrefetch stands in the thread backend (start / take / drop / fill_now /
accept), and each request's grammar is a ProcessGrammar: a key into the process's matchers.
Per step the core only sends a message: the committed tokens and the rows to fill. Termination
needs no answer (a matcher ends only by accepting a stop token, and the mask allows one only
where the grammar may end); a refused token (possible only when the mask left nothing) comes
back with the step's reply and aborts its request at the next commit.

With a StreamGate (CUDA) the device waits for the process's fill on the shared gate word; the
core reads replies when it next commits, and waits there only if the process is behind (it then
checks the process is alive: a dead one has its gate opened by the core, so the device never
hangs). Without one (CPU) `take` waits for the step's reply.
"""

from __future__ import annotations

import itertools
import multiprocessing
from typing import Any, Optional, Sequence

import torch

from engine.grammar.shared_ring import SharedBitmaskRing, SharedSegment
from engine.grammar.stream_gate import StreamGate

REPLY_POLL_S = 0.05
MIN_CAPACITY = 64


class ProcessGrammar:
    """A request's matcher in the grammar process (the scheduler only sees it is not None)."""

    def __init__(self, client: "MatcherClient", key: int, generation: int) -> None:
        self._client, self.key, self.generation = client, key, generation  # generation: which process holds it
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def __del__(self) -> None:  # the request is gone: its matcher can go
        self._client.freed.append(self.key)


class MatcherClient:
    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device) -> None:
        self._setup = (tokenizer_path, vocab_size, list(stop_token_ids))
        self._stop_ids = frozenset(stop_token_ids)
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
        self._refused: set[int] = set()
        self._accepts: list[tuple[int, int]] = []  # (key, token) not sent yet
        self._job: Optional[tuple[Any, int, torch.Tensor]] = None  # (batch, seq, bitmask) posted by start
        self._conn = self._process = None
        self._segment: Optional[SharedSegment] = None

    # ---- grammars ------------------------------------------------------------------------------
    def new(self, kind: str, spec: str) -> ProcessGrammar:
        self._ensure_started()
        key = next(self._keys)
        self._send(("new", key, kind, spec))
        return ProcessGrammar(self, key, self._generation)

    def accept(self, grammars: Sequence[ProcessGrammar], tokens: Sequence[int]) -> list[bool]:
        """Queue each grammar's committed token for the process; False for a grammar that refused
        an earlier token (its request aborts now)."""
        self._read_replies()
        out = []
        for grammar, token in zip(grammars, tokens):
            ok = grammar.generation == self._generation and grammar.key not in self._refused
            if ok and token in self._stop_ids:
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
            self._wait_done(self._seq)

    def shutdown(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
        self._process = self._conn = None
        self._job = None
        if self._segment is not None:
            self.ring.release()
            self._segment.close()
            self._segment = None

    # ---- inside --------------------------------------------------------------------------------
    def _post(self, grammars: Sequence[Optional[ProcessGrammar]]) -> Optional[tuple[int, torch.Tensor]]:
        """Send the queued accepts and, if a row is live, the fill of `grammars`' rows."""
        live = [(row, g.key) for row, g in enumerate(grammars)
                if g is not None and not g.is_terminated() and g.generation == self._generation]
        if not live and not self._accepts:
            return None
        self._ensure_started()
        if self.freed:
            freed, self.freed = self.freed, []
            self._refused.difference_update(freed)
            self._send(("free", freed))
        fill, bitmask = None, None
        if live:
            self._ensure_capacity(len(grammars))
            bitmask = self.ring.take(len(grammars))
            fill = (self.ring.slot_of(bitmask), len(grammars), [r for r, _ in live], [k for _, k in live])
        accepts, self._accepts = self._accepts, []
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._send(("step", self._seq, [k for k, _ in accepts], [t for _, t in accepts], fill))
        return None if bitmask is None else (self._seq, bitmask)

    def _ready(self, seq: int, bitmask: torch.Tensor) -> torch.Tensor:
        """The bitmask once the device (gate) or this thread (no gate) has waited for its fill."""
        if self.gate is None or not self.gate.wait(seq):
            self._wait_done(seq)
        return bitmask

    def _wait_done(self, seq: int) -> None:
        while self._done != seq:
            if self._conn.poll(REPLY_POLL_S):
                self._read_replies()
            elif not self._process.is_alive():
                self._lost()

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            self._lost()

    def _read_replies(self) -> None:
        conn = self._conn
        while conn is not None and conn.poll():
            try:
                reply = conn.recv()
            except EOFError:
                self._lost()
            if reply[0] == "done":
                self._done = reply[1]
                self._refused.update(reply[2])
            else:
                raise RuntimeError(f"the grammar process failed: {reply[1]}")

    def _lost(self) -> None:
        """The process died: the device is let past every posted wait, and the next constrained
        request starts a new process (the requests that had matchers there fail with this)."""
        if self._segment is not None:
            self._segment.open_gate(self._seq)
        self._process = self._conn = None
        self._accepts, self._job, self._done, self.freed = [], None, self._seq, []
        self._generation += 1  # the matchers it held are gone: their grammars now refuse every token
        raise RuntimeError("the grammar process died; its constrained requests cannot continue")

    def _ensure_started(self) -> None:
        if self._process is not None:
            return
        from engine.grammar.matcher_server import serve

        context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve, args=(child, *self._setup), daemon=True,
                                        name="tandem-grammar")
        self._process.start()
        child.close()
        if self._segment is not None:  # a process started after one died: the same buffers
            self._send(("buffers", self._segment.shm.name, self._segment.capacity))
        self._ensure_capacity(MIN_CAPACITY)

    def _ensure_capacity(self, rows: int) -> None:
        if self._segment is not None and self._segment.capacity >= rows:
            return
        capacity = MIN_CAPACITY
        while capacity < rows:
            capacity *= 2
        self.drop()  # the process is done with the old buffers
        segment = SharedSegment.create(capacity, self._setup[1])
        gate = None
        if self.device.type == "cuda" and segment.register():
            gate = StreamGate.create(self.device, segment.word)
        old, self._segment = self._segment, segment
        self.ring.use(segment)
        self._send(("buffers", segment.shm.name, capacity))
        self.gate = gate
        if old is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no queued wait may read the old word after this
            old.close()
        segment.open_gate(self._seq)  # waits already queued were on the old word

