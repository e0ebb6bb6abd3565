"""gumbel_sample under Triton's CPU interpreter against what it replaces: the batch-invariant
log_softmax (of the logits, and of the logits / T) followed by gumbel_argmax and a gather, at
small sizes with several softmax blocks and noise chunks a row (the GPU runs it in
tests/gpu/test_gumbel_sample_gpu.py). The interpreter reduces in numpy whatever the layout, so
bf16's other lane order on the GPU shows only there. Skipped where triton is absent and on CUDA
machines."""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.kernels import gumbel_argmax as ga  # noqa: E402
from engine.kernels import gumbel_sample as gs  # noqa: E402
from engine.kernels.batch_invariant import triton_norm  # noqa: E402

SEEDS = [0, -1, 2**62 + 12345, -(2**63), 7]  # both 32-bit halves, negative int64 patterns
POSITIONS = [0, 5, 2**40 + 3, 17, 2**31]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_norm, "_SOFTMAX_BLOCK", 64)  # several folds a row, both paths alike
    monkeypatch.setattr(ga, "CHUNK", 64)
    monkeypatch.setattr(gs, "CHUNK", 64)


def reference(logits, temperatures, seeds, positions):
    raw = logits.float()
    original = triton_norm.log_softmax(raw)
    processed = original if temperatures is None else triton_norm.log_softmax(raw / temperatures.view(-1, 1))
    ids = ga.gumbel_argmax(processed, seeds, positions)
    pick = ids.unsqueeze(1)
    return ids, original.gather(1, pick).squeeze(1), processed.gather(1, pick).squeeze(1)


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


@pytest.mark.parametrize("vocab", [300, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temps", [None, [1.0, 0.7, 1.3, 1.0, 0.05]])
def test_gumbel_sample_is_log_softmax_then_gumbel_argmax(vocab, dtype, temps):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 3).to(dtype)
    t = None if temps is None else torch.tensor(temps)
    seeds, positions = torch.tensor(SEEDS), torch.tensor(POSITIONS)
    got = gs.gumbel_sample(logits, t, seeds, positions)
    assert_same_bits(got, reference(logits, t, seeds, positions))
    if temps is None:
        assert torch.equal(got[1], got[2])  # T = 1: one distribution
    for row in range(5):  # a row's result does not depend on its batch
        alone = gs.gumbel_sample(logits[row:row + 1], None if t is None else t[row:row + 1],
                                 seeds[row:row + 1], positions[row:row + 1])
        assert all(a[0] == b[row] for a, b in zip(alone, got))


def test_gumbel_sample_strided_rows_and_masked_logits():
    """Rows of a wider buffer (the runner's last-token rows), -inf bans and a row of one allowed id."""
    buf = torch.randn(3, 400)
    logits = buf[:, :250]
    logits[0, :200] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 123] = 0.5
    seeds, positions = torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2])
    got = gs.gumbel_sample(logits, None, seeds, positions)
    assert_same_bits(got, reference(logits.contiguous(), None, seeds, positions))
    assert got[0][0] >= 200 and got[0][1] == 123 and got[1][1] == 0.0


def test_gumbel_sample_empty_and_refusals():
    ids, original, processed = gs.gumbel_sample(torch.zeros(0, 90), None, torch.zeros(0, dtype=torch.int64),
                                                torch.zeros(0, dtype=torch.int64))
    assert ids.shape == original.shape == processed.shape == (0,)
    keys = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous"):
        gs.gumbel_sample(torch.zeros(90, 3).T, None, keys, keys)
