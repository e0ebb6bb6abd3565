"""grammar_vocab_mask: the [B, V] bool mask of tokens the rows' grammars forbid next.

Filled on the host by xgrammar (a packed int32 bitmask, one bit per token), unpacked once and
copied to the device in one transfer; rows without a grammar forbid nothing.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from engine.kernels.device_copy import h2d


def grammar_vocab_mask(grammars: Sequence[Optional[Any]], vocab_size: int,
                       device: torch.device | str) -> Optional[torch.Tensor]:
    """grammars: one RequestGrammar or None per row. None when no row has a grammar."""
    if all(g is None for g in grammars):
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab_size)  # all bits set: all allowed
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_bitmask(bitmask, row)
    return h2d(unpack_forbidden(bitmask, vocab_size), device)


def unpack_forbidden(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit set = allowed) -> [B, V] bool (True = forbidden)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return (bits == 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]
