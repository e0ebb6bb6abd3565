"""MaskPrefetch: the next step's grammar bitmask filled on a worker thread while the host works on.

With overlap scheduling the lookahead step's forward is already on the device when the previous
step's tokens are committed. The rows' matchers are advanced first; the bitmask for the lookahead
step is then filled here while the core finishes the commit (stop checks, outputs) and the runner
prepares the sampling tensors. At ~1 ms a step for 64 JSON rows on the H200's host that fill is
otherwise serial host work on a host-bound decode loop.

The worker must be inside xgrammar's fill (which releases the GIL) before `start` returns. A
Python thread woken while another runs Python gets the GIL only when that one blocks or after
CPython's switch interval (5 ms): a worker merely submitted to would start when the core blocks
in `take`, filling nothing in the background at all. The start-up hand-off costs tens of µs.

With a StreamGate (CUDA) `take` does not wait either: the device waits for the fill instead, the
worker opening the gate when xgrammar returns, and the core joins the worker (`drop`) before it
next reads tokens from the device. Without one (CPU) `take` waits for the fill.

The worker only reads matchers that nothing else touches until the prefetch is joined: `drop`
waits for it, and the core drops any prefetch before it advances matchers again. One long-lived
thread and three plain locks carry the hand-offs: an executor's futures and events are Python
code under the GIL, each step, on a host-bound loop.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from engine.grammar.bitmask_ring import BitmaskRing
from engine.grammar.matcher import accept_tokens
from engine.grammar.vocab_mask import MaskFill, fill_bitmask, prepare_fill, run_fill

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    batch: Any
    fill: MaskFill
    seq: int
    gate: Optional[Any]
    hand_off: bool  # the core waits for the worker to enter the fill
    taken: bool = False  # sampled with while still filling (the device waits on the gate)
    error: Optional[BaseException] = None


class MaskPrefetch:
    def __init__(self, gate: Optional[Any] = None) -> None:
        self.gate = gate  # engine.grammar.stream_gate.StreamGate, or None: take waits on the host
        # False: start returns at once and the worker takes the GIL at CPython's next switch
        # (sys.getswitchinterval): only useful with a short interval (the bench's A/B)
        self.hand_off = True
        self._job: Optional[_Job] = None  # posted and not joined yet
        self._posted: Optional[_Job] = None  # what the worker runs next (None: it stops); only start and shutdown set it
        self._go, self._entered, self._done = _held_lock(), _held_lock(), _held_lock()
        self._worker: Optional[threading.Thread] = None
        self._seq = 0
        self.num_taken = 0  # prefetched masks a step sampled with

    def start(self, batch: Any, grammars: Sequence[Optional[Any]], ring: BitmaskRing) -> None:
        """Fill `batch`'s bitmask (one RequestGrammar or None per row, into a buffer of `ring`) in
        the background; returns once the worker is filling."""
        self.drop()
        fill = prepare_fill(grammars, ring)  # Python work stays on this thread
        if fill is None:
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="tandem-grammar-mask", daemon=True)
            self._worker.start()
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._job = self._posted = _Job(batch, fill, self._seq, self.gate, self.hand_off)
        self._go.release()
        if self.hand_off:
            self._entered.acquire()  # blocks (GIL released) until the worker runs; it hands the GIL back on entering xgrammar

    def take(self, batch: Any) -> Optional[torch.Tensor]:
        """The packed host bitmask prefetched for this very batch, or None (a prefetch for
        another batch is dropped, and a batch with no live grammar had none). With a gate the
        fill may still be running: the device's stream waits for it before what comes next."""
        job = self._job
        if job is None or job.taken or job.batch is not batch:
            self.drop()
            return None
        if job.gate is not None and job.gate.wait(job.seq):
            job.taken = True  # joined by the next drop
        else:
            self._join()
            if job.error is not None:
                return None  # filled again on the core thread, which raises the error there
        self.num_taken += 1
        return job.fill.bitmask

    def fill_now(self, grammars: Sequence[Optional[Any]], ring: BitmaskRing) -> Optional[torch.Tensor]:
        """A batch's bitmask filled on this thread (a step with no prefetch)."""
        return fill_bitmask(grammars, ring)

    @staticmethod
    def accept(grammars: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        """Advance the matchers on their committed tokens (engine.grammar.matcher.accept_tokens)."""
        return accept_tokens(grammars, tokens)

    def drop(self) -> None:
        """Wait for any fill in flight and forget it (its matchers may be advanced after this)."""
        job = self._join()
        if job is not None and job.taken and job.error is not None:
            # the device sampled with an all-allowing mask (see _run); a token the grammar
            # refuses aborts its request when the matchers advance
            logger.error("a grammar mask fill failed", exc_info=job.error)

    def shutdown(self) -> None:
        self.drop()
        if self._worker is not None:
            self._posted = None
            self._go.release()  # no job posted: the worker returns
            self._worker.join()
            self._worker = None

    def _join(self) -> Optional[_Job]:
        job, self._job = self._job, None
        if job is not None:
            self._done.acquire()
        return job

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            job = self._posted  # not self._job: the core may already be joining it
            if job is None:
                return
            if job.hand_off:
                self._entered.release()
            self._run(job)
            self._done.release()

    @staticmethod
    def _run(job: _Job) -> None:
        try:
            run_fill(job.fill)
        except BaseException as exc:  # the mask allows everything now; the core fails the rows
            job.error = exc
        finally:
            if job.gate is not None:
                job.gate.open(job.seq)


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock
