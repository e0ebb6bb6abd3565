"""The grammar mask of a batch: fill_bitmask (host, packed, into a BitmaskRing buffer), then
BitmaskRing.to_device (the packed mask on the device; the sampler applies it: engine/sampling/token_mask.py).

xgrammar fills a packed int32 bitmask on the host (one bit per token; the rows of a batch in
parallel on its thread pool); the packed mask (1/32 of the unpacked bytes: 19 KB a row at a
152k vocabulary) goes to the device in one transfer and is applied there. Rows without a
grammar forbid nothing.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import torch


class MaskFill(NamedTuple):
    """A fill ready to run: the rows of `bitmask` that `matchers` fill (the others allow everything)."""
    bitmask: torch.Tensor
    matchers: list
    rows: list[int]


def prepare_fill(grammars: Sequence[Optional[Any]], ring: Any) -> Optional[MaskFill]:
    """The fill of a batch's rows (one RequestGrammar or None each) into a buffer of `ring`; None
    when no row has a live grammar (a grammar that has terminated allows everything: its request
    is finishing and its token is dropped)."""
    if not any(grammar is not None and not grammar.is_terminated() for grammar in grammars):
        return None
    return prepare_rows(grammars, ring.take(len(grammars)))


def prepare_rows(grammars: Sequence[Optional[Any]], bitmask: torch.Tensor) -> Optional[MaskFill]:
    """The fill of `bitmask`'s rows, one grammar (or None) each; rows without a live grammar are
    set to allow everything now. None when no row has one."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and not grammar.is_terminated()]
    if len(rows) < len(grammars):  # xgrammar writes whole rows; the others must allow everything
        live = set(rows)
        for row in range(len(grammars)):  # a row or two, usually: a fill_ each beats an index_put
            if row not in live:
                bitmask[row].fill_(-1)
    return MaskFill(bitmask, [grammars[row].matcher for row in rows], rows) if rows else None


def run_fill(fill: Optional[MaskFill]) -> Optional[torch.Tensor]:
    """The packed host bitmask [B, ceil(V/32)] int32 of `fill`, bit set = allowed (xgrammar
    releases the GIL and fills the rows on its own threads)."""
    if fill is None:
        return None
    try:
        _batch_matcher().batch_fill_next_token_bitmask(fill.matchers, fill.bitmask, fill.rows)
    except BaseException:
        fill.bitmask.fill_(-1)  # never a half-written mask on the device (the caller fails the rows)
        raise
    return fill.bitmask


def fill_bitmask(grammars: Sequence[Optional[Any]], ring: Any) -> Optional[torch.Tensor]:
    """prepare_fill then run_fill, on the calling thread."""
    return run_fill(prepare_fill(grammars, ring))


@functools.lru_cache(maxsize=1)
def _batch_matcher() -> Any:
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads="auto")
