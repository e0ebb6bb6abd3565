"""Batch-invariant ops and split-KV attention, CPU: a row's bits never depend on the batch.

Every check is `torch.equal` on a row computed among M rows (M = 1..64 and across row tiles) at
the first and at the last position against the same row computed alone, plus closeness to a
float64 reference so the invariant ops are also right.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention.deterministic import split_kv_attention, split_kv_attention_rows
from engine.attention.torch_native import _attend
from engine.kernels import batch_invariant as bi

M_VALUES = list(range(1, 65)) + [bi.ROW_TILE + 1, 3 * bi.ROW_TILE - 1, 257]
FEW_M = [1, 2, 3, 4, 5, 8, 31, 33, 64, 97]  # kernel switch points and row-tile edges
FULL_SWEEP = {(64, 128), (64, 1024)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_rows_invariant(fn, rows: torch.Tensor, m_values=M_VALUES, full_m: int = 65) -> None:
    """fn maps [M, ...] -> [M, ...] row by row; row 0 must not depend on M or its position, and
    in a batch of full_m rows every row must equal that row computed alone."""
    alone = fn(rows[:1])[0]
    for m in m_values:
        first = fn(rows[:m])[0]
        assert torch.equal(first, alone), f"row 0 differs at M={m}"
        last = fn(torch.cat([rows[1:m], rows[:1]]))[-1]
        assert torch.equal(last, alone), f"row moved to position {m - 1} differs at M={m}"
    m = min(full_m, max(m_values))
    batch = fn(rows[:m])
    for i in range(m):
        assert torch.equal(batch[i], fn(rows[i : i + 1])[0]), f"row {i} of M={m} differs from alone"


# (K, N): the tiny model's qkv, o, gate_up, down and lm_head shapes, and wider ones
@pytest.mark.parametrize("k,n", [(64, 128), (64, 64), (64, 256), (128, 64), (64, 1024), (512, 1536),
                                 (1024, 3072)])
def test_linear_rows_invariant_and_exact(k, n):
    x = torch.randn(300, k, generator=_gen(0))
    w = torch.randn(n, k, generator=_gen(1)) * k**-0.5
    b = torch.randn(n, generator=_gen(2))
    # the full sweep on the attention-input and lm_head shapes, kernel switch points elsewhere
    assert_rows_invariant(lambda t: bi.linear(t, w), x, M_VALUES if (k, n) in FULL_SWEEP else FEW_M)
    assert_rows_invariant(lambda t: bi.linear(t, w, b), x, m_values=[1, 5, 40])
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(bi.linear(x, w, b).double(), ref, rtol=1e-5, atol=1e-5)
    assert bi.linear(x.view(3, 100, k), w).shape == (3, 100, n)


@pytest.mark.parametrize("hidden", [16, 64, 4096])
def test_rms_norm_rows_invariant_and_exact(hidden):
    x = torch.randn(300, hidden, generator=_gen(3))
    r = torch.randn(300, hidden, generator=_gen(4))
    w = 1 + 0.1 * torch.randn(hidden, generator=_gen(5))
    assert_rows_invariant(lambda t: bi.rms_norm(t, w, 1e-6), x, M_VALUES if hidden <= 64 else FEW_M)
    assert_rows_invariant(lambda t: torch.cat(bi.rms_norm(t[:, 0], w, 1e-6, t[:, 1]), -1),
                          torch.stack([x, r], 1), m_values=[1, 2, 7, 64, 257], full_m=8)
    out, res = bi.rms_norm(x, w, 1e-6, r)
    s = x.double() + r.double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(res, x + r)


@pytest.mark.parametrize("vocab,m_values", [(1024, M_VALUES), (151936, [1, 2, 3, 4, 9, 33])])
def test_log_softmax_rows_invariant_and_exact(vocab, m_values):
    x = 3 * torch.randn(max(m_values) + 1, vocab, generator=_gen(6))
    assert_rows_invariant(bi.log_softmax, x, m_values)
    torch.testing.assert_close(bi.log_softmax(x).double(), torch.log_softmax(x.double(), -1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [256, 200, 24576])  # 2*d; d=100 leaves a vector tail per row
def test_silu_and_mul_rows_invariant_and_exact(width):
    m_values = [1, 2, 3, 7, 33, 64] if width > 1000 else M_VALUES
    x = 3 * torch.randn(max(m_values) + 1, width, generator=_gen(7))
    assert_rows_invariant(bi.silu_and_mul, x, m_values)
    d = width // 2
    ref = F.silu(x[:, :d].double()) * x[:, d:].double()
    torch.testing.assert_close(bi.silu_and_mul(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_thread_split_inside_a_row():
    """1001 rows of width 100: with 2 threads the split falls in the middle of row 500, whose
    elements then take the vector/scalar paths differently than alone (F.silu fails this with
    this seed here; the exp form does not care which path an element takes)."""
    x = 3 * torch.randn(1001, 200, generator=_gen(0))
    batch = bi.silu_and_mul(x)
    for i in range(1001):
        assert torch.equal(batch[i], bi.silu_and_mul(x[i : i + 1])[0]), f"row {i}"


# ---- attention --------------------------------------------------------------------------------
def _qkv(seq_len: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 8):
    g = _gen(seed)
    q = torch.randn(seq_len, heads, dim, generator=g)
    k = torch.randn(seq_len, kv_heads, dim, generator=g)
    v = torch.randn(seq_len, kv_heads, dim, generator=g)
    return q, k, v


def _prefill(q, k, v, split, scaling=0.25):
    return split_kv_attention(q, k, v, torch.arange(q.shape[0]), scaling, split)


def _reference(q, k, v, scaling=0.25):
    """Causal GQA softmax attention in float64; kv head h // group serves query head h (HF)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scaling
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("split", [16, 64])
def test_split_kv_prefill_equals_decode(split):
    q, k, v = _qkv(150)
    full = _prefill(q, k, v, split)
    for p in [0, 1, split - 1, split, split + 1, 2 * split, 100, 149]:
        # decode: one query row, only the keys written so far
        one = split_kv_attention(q[p : p + 1], k[: p + 1], v[: p + 1], torch.tensor([p]), 0.25, split)
        assert torch.equal(one[0], full[p]), f"position {p}"


def test_split_kv_decode_batch_rows_equal_each_sequence_alone():
    lengths = [1, 63, 64, 65, 150, 7, 129]
    seqs = [_qkv(n, seed=20 + i) for i, n in enumerate(lengths)]
    L = max(lengths)
    pad = lambda t: F.pad(t, (0, 0, 0, 0, 0, L - t.shape[0]), value=1e30)  # noqa: E731 (ignored: past the end)
    q = torch.stack([sq[-1] for sq, _, _ in seqs])
    k = torch.stack([pad(sk) for _, sk, _ in seqs])
    v = torch.stack([pad(sv) for _, _, sv in seqs])
    rows = split_kv_attention_rows(q, k, v, torch.tensor(lengths) - 1, 0.25, 64)
    for i, (sq, sk, sv) in enumerate(seqs):
        assert torch.equal(rows[i], _prefill(sq, sk, sv, 64)[-1]), f"sequence {i}"


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_split_kv_chunked_prefill_equals_whole(chunk):
    q, k, v = _qkv(150)
    full = _prefill(q, k, v, 64)
    parts = [split_kv_attention(q[s : s + chunk], k[: s + chunk], v[: s + chunk],
                                torch.arange(s, min(s + chunk, 150)), 0.25, 64)
             for s in range(0, 150, chunk)]
    assert torch.equal(torch.cat(parts), full)


@settings(max_examples=25, deadline=None)
@given(seq_len=st.integers(1, 200), split=st.sampled_from([8, 16, 64]), data=st.data())
def test_split_kv_any_chunking_equals_whole(seq_len, split, data):
    """Random chunk cuts (as chunked prefill and prefix caching make them) change no bit."""
    q, k, v = _qkv(seq_len, seed=seq_len)
    cuts = sorted(data.draw(st.sets(st.integers(1, seq_len - 1), max_size=6)) if seq_len > 1 else [])
    bounds = [0, *cuts, seq_len]
    parts = [split_kv_attention(q[a:b], k[:b], v[:b], torch.arange(a, b), 0.25, split)
             for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), _prefill(q, k, v, split))


def test_split_kv_close_to_reference_and_gqa_layout():
    q, k, v = _qkv(150)
    ours = _prefill(q, k, v, 64)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), _reference(q, k, v), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, _attend(q, k, v, 0, 0.25), rtol=1e-5, atol=1e-6)


def test_split_kv_split_size_changes_bits():
    """Negative control: the comparisons above do see a changed reduction order."""
    q, k, v = _qkv(150)
    a, b = _prefill(q, k, v, 64), _prefill(q, k, v, 16)
    assert torch.equal(a[:16], b[:16])  # one split either way: same arithmetic
    assert not torch.equal(a[16:], b[16:])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_split_kv_gradients_match_reference():
    q, k, v = (t.double().requires_grad_(True) for t in _qkv(90, seed=9))
    grads = []
    for fn in (lambda: _prefill(q, k, v, 16), lambda: _reference(q, k, v)):
        out = fn()
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype)
                                          .view_as(out)).sum(), (q, k, v)))
    for ours, ref in zip(*grads):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)  # float32 inside


def test_linear_caps_torchs_threads_where_mkl_could_split_k(monkeypatch):
    """More than MAX_INVARIANT_THREADS threads may split K (no tile holds then): the first CPU call
    caps them, so a many-core host keeps the bits of a 2-core one."""
    from engine.kernels.batch_invariant import ops

    before = torch.get_num_threads()
    ops._cap_threads.cache_clear()
    try:
        torch.set_num_threads(ops.MAX_INVARIANT_THREADS + 8)
        bi.linear(torch.randn(3, 32), torch.randn(5, 32))
        assert torch.get_num_threads() == ops.MAX_INVARIANT_THREADS
    finally:
        torch.set_num_threads(before)
        ops._cap_threads.cache_clear()
