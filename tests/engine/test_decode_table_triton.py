"""write_decode_table (engine/kernels/decode_table.py): one launch writes the decode block table
that split_kv_plan's torch ops build (decode_block_table with decode_split_lens), bit for bit, in
both modes, with cascade prefixes, into a wider graph buffer, and on the device (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

triton = import_triton_or_skip()

from engine.attention.split_kv_plan import MIN_DECODE_SPLIT, decode_block_table, decode_split_lens  # noqa: E402
from engine.kernels.decode_table import write_decode_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bs", [1, 3, 64, 1500])
@pytest.mark.parametrize("lanes, block_n", [(1, 128), (4, 128), (7, 64), (32, 128)])
@pytest.mark.parametrize("cascade", [False, True])
def test_normal_mode_table_equals_the_torch_ops(bs, lanes, block_n, cascade):
    g = torch.Generator().manual_seed(bs * 100 + lanes)
    seq_lens = torch.randint(1, 40_000, (bs,), generator=g).to(DEVICE)
    prefix = None
    own = seq_lens
    if cascade:  # int32, below each row's length (0: no shared prefix)
        prefix = (torch.rand(bs, generator=g).to(DEVICE) * seq_lens).to(torch.int32)
        own = seq_lens - prefix
    ref = decode_block_table(seq_lens, decode_split_lens(own, lanes, block_n, MIN_DECODE_SPLIT))
    out = torch.full((5, bs + 9), -7, dtype=torch.int32, device=DEVICE)  # a graph's buffer is wider
    write_decode_table(out, seq_lens, lanes=lanes, block_n=block_n, min_split=MIN_DECODE_SPLIT, prefix_lens=prefix)
    assert torch.equal(out[:, :bs], ref)
    assert (out[:, bs:] == -7).all()  # nothing past the batch


@pytest.mark.parametrize("split", [256, 1 << 30])
def test_fixed_split_table_equals_the_torch_ops(split):
    seq_lens = torch.tensor([1, 2, 255, 256, 257, 100_000], device=DEVICE)
    out = torch.empty((5, 6), dtype=torch.int32, device=DEVICE)
    write_decode_table(out, seq_lens, fixed_split=split)
    assert torch.equal(out, decode_block_table(seq_lens, split))


def test_refusals():
    seq_lens = torch.ones(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        write_decode_table(torch.empty((5, 4), dtype=torch.int64, device=DEVICE), seq_lens, fixed_split=8)
    with pytest.raises(ValueError, match=">= 4"):
        write_decode_table(torch.empty((5, 3), dtype=torch.int32, device=DEVICE), seq_lens, fixed_split=8)
    with pytest.raises(ValueError, match="prefix"):
        write_decode_table(torch.empty((5, 4), dtype=torch.int32, device=DEVICE), seq_lens,
                           prefix_lens=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    write_decode_table(torch.empty((5, 0), dtype=torch.int32, device=DEVICE), seq_lens[:0], fixed_split=8)
