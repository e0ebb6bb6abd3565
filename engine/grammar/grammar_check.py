"""GrammarCheck: the front end's verdict on a request's grammar, before the request is submitted.

Size limits first (engine/grammar/grammar_limits.py), then a compile in a killable worker under
a time limit (engine/grammar/compile_pool.py). Verdicts are remembered per (kind, spec digest):
the 64 samples of a GRPO group compile once, and a grammar that ran over its limit is refused at
once when it comes again, without holding a worker for another time limit.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from collections import OrderedDict
from typing import Any, Callable, Optional

from engine.grammar.compile_pool import CompilePool, GrammarUnavailable
from engine.grammar.grammar_limits import GrammarLimits, check_grammar_size

REMEMBERED_VERDICTS = 4096
_UNKNOWN = object()


class GrammarCheck:
    def __init__(self, make_pool: Callable[[], CompilePool], limits: GrammarLimits) -> None:
        self._make_pool = make_pool  # built on the first grammar: it indexes the vocabulary
        self._pool: Optional[CompilePool] = None
        self.limits = limits
        self._verdicts: OrderedDict[tuple[str, bytes], Optional[str]] = OrderedDict()  # None: compiles
        self._pending: dict[tuple[str, bytes], Future] = {}  # compiling now: later copies wait on it
        self._lock = threading.Lock()
        self._closed: Optional[str] = None  # why no grammar is checked any more

    def check(self, kind: str, spec: str) -> None:
        """ValueError naming what is wrong with the grammar (GrammarUnavailable at shutdown)."""
        check_grammar_size(kind, spec, self.limits)
        key = (kind, hashlib.blake2b(spec.encode("utf-8", "surrogatepass"), digest_size=20).digest())
        with self._lock:
            verdict = self._verdicts.get(key, _UNKNOWN)
            pending = self._pending.get(key) if verdict is _UNKNOWN else None
            mine = verdict is _UNKNOWN and pending is None
            if mine:  # the same grammar sent again meanwhile waits for this compile
                pending = self._pending[key] = Future()
        if mine:
            try:
                verdict = self._compile(kind, spec)
                self._remember(key, verdict)
                pending.set_result(verdict)
            except BaseException as exc:  # GrammarUnavailable: no verdict, the waiters get it too
                pending.set_exception(exc)
                raise
            finally:
                with self._lock:
                    self._pending.pop(key, None)
        elif verdict is _UNKNOWN:
            verdict = pending.result()
        if verdict is not None:
            raise ValueError(verdict)

    def close(self, reason: str = "the server is shutting down") -> None:
        with self._lock:
            self._closed = reason
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(reason)

    def _compile(self, kind: str, spec: str) -> Optional[str]:
        try:
            self._get_pool().check(kind, spec)
            return None
        except ValueError as exc:
            return str(exc)

    def _get_pool(self) -> CompilePool:
        with self._lock:
            if self._closed is not None:
                raise GrammarUnavailable(f"{self._closed}; the grammar was not compiled")
            if self._pool is None:
                self._pool = self._make_pool()
            return self._pool

    def _remember(self, key: tuple[str, bytes], verdict: Optional[str]) -> None:
        with self._lock:
            self._verdicts[key] = verdict
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > REMEMBERED_VERDICTS:
                self._verdicts.popitem(last=False)


def make_grammar_check(tokenizer: Any, vocab_size: int, limits: GrammarLimits, workers: int) -> GrammarCheck:
    from engine.grammar.compiler import tokenizer_info

    return GrammarCheck(lambda: CompilePool(tokenizer_info(tokenizer, vocab_size), vocab_size, limits, workers),
                        limits)
