"""The grammar mask of a batch: fill_bitmask (host, packed), then bitmask_to_device ([B, V] bool,
True = the row's grammar forbids that token next).

xgrammar fills a packed int32 bitmask on the host (one bit per token; the rows of a batch in
parallel on its thread pool); the packed mask (1/32 of the unpacked bytes: 19 KB a row at a
152k vocabulary) goes to the device in one transfer and is unpacked there. Rows without a
grammar forbid nothing.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import torch

from engine.kernels.device_copy import h2d


class MaskFill(NamedTuple):
    """A fill ready to run: the rows of `bitmask` that `matchers` fill (the others allow everything)."""
    bitmask: torch.Tensor
    matchers: list
    rows: list[int]


def prepare_fill(grammars: Sequence[Optional[Any]], vocab_size: int) -> Optional[MaskFill]:
    """The fill of a batch's rows (one RequestGrammar or None each); None when no row has a live
    grammar (a grammar that has terminated allows everything: its request is finishing and its
    token is dropped)."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None and not grammar.is_terminated()]
    if not rows:
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab_size)  # all bits set: all allowed
    return MaskFill(bitmask, [grammars[row].matcher for row in rows], rows)


def run_fill(fill: Optional[MaskFill]) -> Optional[torch.Tensor]:
    """The packed host bitmask [B, ceil(V/32)] int32 of `fill` (xgrammar releases the GIL and
    fills the rows on its own threads)."""
    if fill is None:
        return None
    _batch_matcher().batch_fill_next_token_bitmask(fill.matchers, fill.bitmask, fill.rows)
    return fill.bitmask


def fill_bitmask(grammars: Sequence[Optional[Any]], vocab_size: int) -> Optional[torch.Tensor]:
    """prepare_fill then run_fill, on the calling thread."""
    return run_fill(prepare_fill(grammars, vocab_size))


def bitmask_to_device(bitmask: Optional[torch.Tensor], vocab_size: int,
                      device: torch.device | str) -> Optional[torch.Tensor]:
    return None if bitmask is None else unpack_forbidden(h2d(bitmask, device), vocab_size)


def unpack_forbidden(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit set = allowed) -> [B, V] bool (True = forbidden), on bitmask's device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return (bits == 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]


@functools.lru_cache(maxsize=1)
def _batch_matcher() -> Any:
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads="auto")
