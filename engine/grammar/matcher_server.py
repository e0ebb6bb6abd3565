"""The grammar process: every constrained request's xgrammar matcher, advanced and masked here.

The core's thread backend advances matchers and fills masks under the core's GIL: at 64 rows on
the H200's host the accept alone is ~0.2 ms of a ~3.5 ms host-bound step and handing the fill to a
thread ~0.2 ms more. Here both run in a process of their own. The core sends one message a step
(the tokens just committed, and which rows of which buffer to fill); this process writes the
packed bitmask into shared memory and then the step's sequence number into the shared gate word
the device waits on (engine/grammar/stream_gate.py), so the core never waits for either.

Messages (tuples, from the core only, over a socket; engine/grammar/server_process.py starts it):
  ("new", key, kind, spec)                  a matcher for a request whose grammar the core compiled
  ("free", keys)                            requests that finished
  ("step", seq, keys, tokens, fill)         advance keys' matchers on tokens; fill = None or
                                            (slot, n_rows, rows, row_keys): fill those rows of that
                                            buffer (the others allow everything), then open seq
  ("buffers", label, capacity)              map this shared segment (the first, or a larger one): its
                                            memfd descriptor follows on the socket (SCM_RIGHTS)
  ("warm",)                                 index the vocabulary now, before the first grammar
  ("stop",)
Replies: ("done", seq, refused_keys) per step, ("refused", key,
message) for a matcher it could not make, ("error", message) for anything else that failed.
A segment it cannot map ends this process: the core then opens the gate and starts another.

A "new" compiles here too (compiled grammars do not pickle), through this process's own cache:
the core sends it once its own compile is done, so this one runs right after the core's and a
new schema holds this process's next step up for one compile (tens of ms; at most
--grammar-compile-timeout, which the front end's check enforced, below --grammar-step-timeout).
"""

from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any, Optional

import torch

from engine.grammar.matcher import RequestGrammar, accept_tokens
from engine.grammar.shared_ring import SharedSegment
from engine.grammar.vocab_mask import prepare_rows, run_fill


class MatcherServer:
    def __init__(self, conn: Any, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 cache_bytes: int) -> None:
        self.conn = conn
        self._tokenizer_path, self._vocab_size, self._stop_ids = tokenizer_path, vocab_size, stop_token_ids
        self._cache_bytes = cache_bytes
        self._compiler = None  # built on the first "new": indexing the vocabulary takes ~1 s
        self.grammars: dict[int, RequestGrammar] = {}
        self._segment: Optional[SharedSegment] = None

    def run(self) -> None:
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except EOFError:  # the core is gone
                    return
                if msg[0] == "stop":
                    return
                try:
                    getattr(self, "_on_" + msg[0])(*msg[1:])
                except Exception as exc:  # reported; the core fails what depended on it
                    self.conn.send(("error", f"{msg[0]}: {type(exc).__name__}: {exc}"))
        finally:
            if self._segment is not None:
                self._segment.close()

    def _on_warm(self) -> None:
        if self._compiler is None:
            from engine.grammar.compiler import GrammarCompiler
            from engine.tokenizer import load_tokenizer

            self._compiler = GrammarCompiler(load_tokenizer(self._tokenizer_path), self._vocab_size, self._stop_ids,
                                             cache_bytes=self._cache_bytes)

    def _on_new(self, key: int, kind: str, spec: str) -> None:
        try:
            self._on_warm()
            self.grammars[key] = RequestGrammar(self._compiler.compile(kind, spec))
        except Exception as exc:  # that request's rows must not go unconstrained: the core aborts it
            self.conn.send(("refused", key, f"the grammar process could not compile it: {exc}"))

    def _on_free(self, keys: list[int]) -> None:
        for key in keys:
            self.grammars.pop(key, None)

    def _on_buffers(self, label: str, capacity: int) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        try:
            fd = recv_handle(self.conn)  # sent right behind this message
            self._segment = SharedSegment.attach(fd, label, capacity, self._vocab_size)
        except Exception as exc:  # without buffers no gate can open: end, and let the core start another
            self.conn.send(("error", f"cannot map the shared masks {label}: {exc}"))
            raise SystemExit(1) from None

    def _on_step(self, seq: int, keys: list[int], tokens: list[int], fill: Optional[tuple]) -> None:
        refused: list[int] = []
        try:
            live = [(key, token) for key, token in zip(keys, tokens) if key in self.grammars]
            if live:
                accepted = accept_tokens([self.grammars[k] for k, _ in live], [t for _, t in live])
                refused = [key for (key, _), ok in zip(live, accepted) if not ok]
            if fill is not None:
                self._fill(*fill)
        except Exception as exc:  # their rows go unconstrained now: their requests must abort
            if fill is not None and self._segment is not None:  # never a stale mask on the device
                self._segment.buffer(fill[0])[:fill[1]].fill_(-1)
            for key in sorted(set(keys) | set(fill[3] if fill is not None else ())):
                self.conn.send(("refused", key, f"the grammar process failed on a step: {type(exc).__name__}: {exc}"))
            raise
        finally:
            if self._segment is not None:
                self._segment.open_gate(seq)  # even after an error: the device must never wait forever
            self.conn.send(("done", seq, refused))

    def _fill(self, slot: int, n_rows: int, rows: list[int], row_keys: list[int]) -> None:
        bitmask = self._segment.buffer(slot)[:n_rows]
        grammars: list[Optional[RequestGrammar]] = [None] * n_rows
        for row, key in zip(rows, row_keys):
            grammars[row] = self.grammars.get(key)
        run_fill(prepare_rows(grammars, bitmask))  # a failed fill leaves the rows allowing everything


def serve(conn: Any, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], cache_bytes: int) -> None:
    torch.set_num_threads(1)  # only xgrammar's own threads work here
    MatcherServer(conn, tokenizer_path, vocab_size, stop_token_ids, cache_bytes).run()


if __name__ == "__main__":  # started by engine/grammar/server_process.py: FD SETUP_JSON
    serve(Connection(int(sys.argv[1])), *json.loads(sys.argv[2]))
