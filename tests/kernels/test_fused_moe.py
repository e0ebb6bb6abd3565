"""fused_moe's Triton kernels under Triton's CPU interpreter, small sizes (H=32 or 128, I=16, E=4..8, K=2).

Against a float64 oracle (fused_moe_reference on float64 inputs: no rounding anywhere) and the
same-dtype torch reference; the align step exactly; deterministic-mode batch invariance bitwise.
The interpreter's dot is numpy's (patched to be row invariant and to multiply bf16 values, see
engine/testing/triton_for_tests.py), so bitwise claims here check the schedule (tiles, order,
padding), not the tensor cores: tests/gpu/test_fused_moe_gpu.py checks those on the device.
Skipped where triton is absent (CI) and on CUDA machines (the GPU tests run compiled).
"""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.kernels.fused_moe import fused_moe, fused_moe_reference  # noqa: E402
from engine.kernels.moe_align import max_padded_rows, moe_align  # noqa: E402

I = 16
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative L2 error vs the float64 oracle


def _routes(T, E, K, g, skew=None):
    """topk_ids [T, K] int32 (distinct experts per token; skew: this expert in most tokens) and
    normalised float32 weights."""
    logits = torch.randn(T, E, generator=g)
    if skew is not None:
        logits[: (3 * T) // 4, skew] += 10.0
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.int()


def _case(T, E, K=2, H=32, dtype=torch.float32, seed=0, skew=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    return (hidden, w13, w2, *_routes(T, E, K, g, skew))


def _rel(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _oracle(hidden, w13, w2, weights, ids):
    return fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights.double(), ids)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (5, 4, 2), (33, 8, 2), (20, 4, 4)])
def test_align_groups_entries_by_expert(T, E, K, block_m):
    _, ids = _routes(T, E, K, torch.Generator().manual_seed(T))
    al = moe_align(ids, E, block_m)
    total = int(al.total)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total == int(padded.sum()) <= al.sorted_ids.numel() == max_padded_rows(T * K, E, block_m)
    start = 0
    for e in range(E):
        group = al.sorted_ids[start: start + int(padded[e])]
        want = (ids.flatten() == e).nonzero().flatten().int()  # ascending entry ids
        assert torch.equal(group[: len(want)], want)
        assert (group[len(want):] == T * K).all()  # the sentinel
        assert (al.expert_ids[start // block_m: (start + int(padded[e])) // block_m] == e).all()
        start += int(padded[e])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,H", [(5, 4, 32), (17, 8, 32), (33, 8, 128)])
def test_matches_float64_reference(T, E, H, dtype, deterministic):
    case = _case(T, E, H=H, dtype=dtype, seed=T + E)
    out = fused_moe(*case, deterministic=deterministic)
    assert out.dtype == dtype and out.shape == (T, H)
    assert _rel(out, _oracle(*case)) < BOUND[dtype]
    # the same-dtype reference rounds where the kernels do: closer than either is to the oracle
    assert _rel(out, fused_moe_reference(*case)) < BOUND[dtype] / 4


def test_skewed_routes_and_unrouted_experts():
    """One expert takes most tokens (several BLOCK_M blocks), two experts none."""
    hidden, w13, w2, weights, ids = _case(40, 8, skew=3, seed=5)
    ids = torch.where(ids >= 6, ids - 6, ids)  # experts 6 and 7 unrouted
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 6, ids[:, 1])  # distinct per token
    case = (hidden, w13, w2, weights, ids)
    assert set(ids.flatten().tolist()) == set(range(6))
    assert _rel(fused_moe(*case), _oracle(*case)) < BOUND[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_rows_do_not_depend_on_the_batch(dtype):
    """Token rows alone, in a small batch and in a batch that overloads their experts: bitwise."""
    hidden, w13, w2, weights, ids = _case(33, 8, dtype=dtype, seed=7, skew=2)
    full = fused_moe(hidden, w13, w2, weights, ids, deterministic=True)
    for rows in ([0], [32], [5, 1, 30], list(range(20, 33))):
        sub = fused_moe(hidden[rows], w13, w2, weights[rows], ids[rows], deterministic=True)
        assert torch.equal(sub, full[rows]), rows
    # the first token among other tokens with other routes
    other = _case(9, 8, dtype=dtype, seed=8)
    mixed = fused_moe(torch.cat([hidden[:1], other[0]]), w13, w2, torch.cat([weights[:1], other[3]]),
                      torch.cat([ids[:1], other[4]]), deterministic=True)
    assert torch.equal(mixed[:1], full[:1])


def test_grads_are_the_reference_grads():
    hidden, w13, w2, weights, ids = _case(6, 4, seed=3)
    leaves = [t.clone().requires_grad_() for t in (hidden, w13, w2, weights)]
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, w13, w2, weights)]
    probe = torch.randn(6, 32, generator=torch.Generator().manual_seed(4))
    (fused_moe(*leaves, ids) * probe).sum().backward()
    (fused_moe_reference(*ref_leaves, ids) * probe).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert got.grad is not None and torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_empty_batch_and_bad_shapes():
    hidden, w13, w2, weights, ids = _case(3, 4)
    assert fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(hidden, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(hidden, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="dtypes"):
        fused_moe(hidden, w13, w2, weights, ids.float())
