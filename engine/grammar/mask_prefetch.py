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
waits for it, and the core drops any prefetch before it advances matchers again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from engine.grammar.bitmask_ring import BitmaskRing
from engine.grammar.vocab_mask import MaskFill, prepare_fill, run_fill

logger = logging.getLogger(__name__)


class MaskPrefetch:
    def __init__(self, gate: Optional[Any] = None) -> None:
        self.gate = gate  # engine.grammar.stream_gate.StreamGate, or None: take waits on the host
        self._pool: Optional[ThreadPoolExecutor] = None
        self._batch: Any = None
        self._fill: Optional[MaskFill] = None
        self._future: Optional[Future] = None  # the fill, until taken
        self._gated: Optional[Future] = None  # a taken fill the device waits for, until joined
        self._seq = 0
        self.num_taken = 0  # prefetched masks a step sampled with

    def start(self, batch: Any, grammars: Sequence[Optional[Any]], ring: BitmaskRing) -> None:
        """Fill `batch`'s bitmask (one RequestGrammar or None per row, into a buffer of `ring`) in
        the background; returns once the worker is filling."""
        self.drop()
        fill = prepare_fill(grammars, ring)  # Python work stays on this thread
        if fill is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "tandem-grammar-mask")
        entered = threading.Event()
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._batch, self._fill = batch, fill
        self._future = self._pool.submit(_fill_in_background, fill, entered, self.gate, self._seq)
        entered.wait()  # blocks (GIL released) until the worker runs; it hands the GIL back on entering xgrammar

    def take(self, batch: Any) -> Optional[torch.Tensor]:
        """The packed host bitmask prefetched for this very batch, or None (a prefetch for
        another batch is dropped, and a batch with no live grammar had none). With a gate the
        fill may still be running: the device's stream waits for it before what comes next."""
        if self._future is None or self._batch is not batch:
            self.drop()
            return None
        future, fill = self._future, self._fill
        self._future, self._fill, self._batch = None, None, None
        if self.gate is not None and self.gate.wait(self._seq):
            self._gated = future
            self.num_taken += 1
            return fill.bitmask
        if future.exception() is not None:
            return None  # filled again on the core thread, which raises the error there
        self.num_taken += 1
        return future.result()

    def drop(self) -> None:
        """Wait for any fill in flight and forget it (its matchers may be advanced after this)."""
        future, self._future, self._fill, self._batch = self._future, None, None, None
        if future is not None:
            future.exception()  # waits; a failed fill is simply recomputed on the core thread
        gated, self._gated = self._gated, None
        if gated is not None and gated.exception() is not None:
            # the device sampled with an all-allowing mask (see _fill_in_background); a token the
            # grammar refuses aborts its request when the matchers advance
            logger.error("a grammar mask fill failed", exc_info=gated.exception())

    def shutdown(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _fill_in_background(fill: MaskFill, entered: threading.Event, gate: Optional[Any], seq: int) -> Optional[torch.Tensor]:
    entered.set()
    try:
        return run_fill(fill)
    except BaseException:
        fill.bitmask.fill_(-1)  # never a half-written mask on the device
        raise
    finally:
        if gate is not None:
            gate.open(seq)
