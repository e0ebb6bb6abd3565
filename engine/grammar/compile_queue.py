"""GrammarQueue: a constrained request waits here while its grammar compiles on a worker thread.

The core loop never compiles: on a Qwen-sized vocabulary xgrammar takes ~0.5 s to index the
tokenizer (the first constrained request) and tens of ms per new schema, which would stall every
running batch. xgrammar releases the GIL while it compiles, so the loop keeps stepping. A grammar
already compiled (every sample of a GRPO group after the first) is attached at once.

The front end has checked each grammar under the same limits (engine/grammar/grammar_check.py),
so these compiles are bounded already; still, one that runs over the time limit here fails its
request at the limit (its thread cannot be stopped and finishes into the cache). As in the
compile pool, grammars of at most SMALL_SPEC_BYTES have a thread of their own, so a simple
schema never waits behind a large one.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from engine.grammar.compile_pool import SMALL_SPEC_BYTES
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.matcher import RequestGrammar


class GrammarQueue:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler],
                 make_grammar: Callable[[Any, tuple[str, str]], Any] = lambda compiled, spec: RequestGrammar(compiled),
                 workers: int = 2, timeout_s: float = 10.0) -> None:
        self._make_compiler = make_compiler
        self._make_grammar = make_grammar  # (compiled, spec) -> the request's grammar
        self._compiler: Optional[GrammarCompiler] = None  # built on a worker: indexing the vocab is slow
        self._compiler_lock = threading.Lock()
        self._workers, self.timeout_s = workers, timeout_s
        self._pools: Optional[tuple[ThreadPoolExecutor, ThreadPoolExecutor]] = None  # (small grammars, the others)
        self.waiting: list[tuple[Any, tuple[str, str], Future]] = []  # (request, spec, its compile), in arrival order

    def submit(self, req: Any, spec: tuple[str, str]) -> Optional[RequestGrammar]:
        """The request's matcher now if its grammar is compiled already, else None: it waits here
        until `pop_ready` hands it back."""
        compiled = self._compiler.cached(*spec) if self._compiler is not None else None
        if compiled is not None:
            return self._make_grammar(compiled, spec)
        if self._pools is None:
            self._pools = (ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar-small"),
                           ThreadPoolExecutor(max(1, self._workers - 1), thread_name_prefix="tandem-grammar"))
        pool = self._pools[0 if len(spec[1]) <= SMALL_SPEC_BYTES else 1]
        started = _Started()
        future = pool.submit(self._compile, spec, started)
        future.started = started  # type: ignore[attr-defined]  # read by _over_time
        self.waiting.append((req, spec, future))
        return None

    def pop_ready(self) -> list[tuple[Any, Optional[RequestGrammar], Optional[str]]]:
        """(request, matcher, None) for each compiled grammar, (request, None, reason) for each
        that failed; those still compiling stay."""
        ready = [entry for entry in self.waiting if entry[2].done() or self._over_time(entry[2])]  # read once per entry
        if not ready:
            return []
        taken = {id(entry) for entry in ready}
        self.waiting = [entry for entry in self.waiting if id(entry) not in taken]
        return [self._made(req, spec, future) for req, spec, future in ready]

    def _over_time(self, future: Future) -> bool:
        started = future.started.at  # type: ignore[attr-defined]
        return started is not None and time.monotonic() - started > self.timeout_s

    def _made(self, req: Any, spec: tuple[str, str], future: Future) -> tuple[Any, Optional[Any], Optional[str]]:
        if not future.done():
            return req, None, (f"its {spec[0]} did not compile within {self.timeout_s:g} s "
                               "(--grammar-compile-timeout)")
        error = future.exception()
        if error is not None:
            return req, None, str(error)
        try:
            return req, self._make_grammar(future.result(), spec), None
        except Exception as exc:  # the grammar process could not take it: this request fails, the others go on
            return req, None, f"structured output unavailable: {exc}"

    def wait(self, timeout_s: float) -> None:
        """Until a waiting compile ends or the timeout passes (the loop has nothing else to do)."""
        if self.waiting:
            concurrent.futures.wait([f for _, _, f in self.waiting], min(timeout_s, self.timeout_s),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def remove(self, rid: str) -> Optional[Any]:
        """Take a waiting request out (it was aborted); its compile still fills the cache."""
        for i, (req, _, _) in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                return req
        return None

    def rids(self) -> list[str]:
        return [req.rid for req, _, _ in self.waiting]

    def shutdown(self) -> None:
        for pool in self._pools or ():
            pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: tuple[str, str], started: "_Started") -> Any:
        with self._compiler_lock:  # one index of the vocabulary, however many threads ask first
            if self._compiler is None:
                self._compiler = self._make_compiler()
        started.at = time.monotonic()
        return self._compiler.compile(*spec)


class _Started:
    """When a compile began on its thread (None while it queues): its time limit counts from there."""

    def __init__(self) -> None:
        self.at: Optional[float] = None
