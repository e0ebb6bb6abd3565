"""fused_moe_reference, the MoE's CPU path (pure torch, runs in CI): the formula against a float64
per-token loop written out here, and bitwise batch invariance in deterministic mode (a token's row
alone, among others, and with its experts overloaded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import fused_moe_reference

H, I, E, K = 64, 32, 8, 2


def _case(T, seed, dtype=torch.float32, skew=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if skew is not None:
        logits[:, skew] += 6.0
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return hidden, w13, w2, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def _per_token(hidden, w13, w2, w, ids):
    """The issue's formula, token by token, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        h = hidden[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = w13[e, :I].double() @ h, w13[e, I:].double() @ h
            out[t] += float(w[t, k]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_matches_the_per_token_formula(dtype, bound, deterministic):
    case = _case(19, seed=1, dtype=dtype)
    out = fused_moe_reference(*case, deterministic=deterministic)
    ref = _per_token(*case)
    assert out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_rows_do_not_depend_on_the_batch(dtype):
    hidden, w13, w2, w, ids = _case(61, seed=2, dtype=dtype, skew=3)
    full = fused_moe_reference(hidden, w13, w2, w, ids, deterministic=True)
    for rows in ([0], [60], [7, 2], list(range(10, 40)), list(range(60, -1, -2))):
        sub = fused_moe_reference(hidden[rows], w13, w2, w[rows], ids[rows], deterministic=True)
        assert torch.equal(sub, full[rows]), rows
