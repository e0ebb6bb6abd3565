"""Batch-invariant Triton kernels, at small sizes.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1); with CUDA they run
compiled. Small K/N, but the same code paths as the real shapes: several K splits, the "par" and
"seq" schedules, fused and kernel reductions, TMA and pointer loads, partial tiles in M, N and K.
Skipped where Triton is not installed (CI).
"""

from __future__ import annotations


import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton = import_triton_or_skip()

from engine.kernels.batch_invariant import triton_matmul, triton_norm, triton_ops  # noqa: E402

MS = (1, 3, 8, 17, 64)
# 16-row tiles, 64-wide K splits: K=200 gives 4 splits (last one partial), N=72 a partial N tile;
# par_max_tiles=8 makes M <= 8 run "par" and M >= 17 run "seq" under the automatic choice.
BASE = dict(block_m=16, block_n=32, block_k=32, split_k=64, num_warps=4, dot_precision="ieee",
            num_stages=2, par_max_tiles=8)
CONFIGS = {
    "ptr-flat-fused": triton_matmul.MatmulConfig(**BASE, use_tma=False),
    "tma-nested-kernel": triton_matmul.MatmulConfig(**BASE, use_tma=True, flat=False, reduce="kernel"),
    "tma-flat-fused": triton_matmul.MatmulConfig(**BASE, use_tma=True),
    "one-split": triton_matmul.MatmulConfig(**{**BASE, "split_k": 0}, use_tma=False),
}


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in CONFIGS]
                         + [("ptr-flat-fused", torch.bfloat16), ("tma-nested-kernel", torch.bfloat16)])
def test_linear_rows_do_not_depend_on_batch(name, dtype):
    cfg = CONFIGS[name]
    K, N = 200, 72
    x, w, b = _rand(64, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1), _rand(N, dtype=dtype, seed=2)
    def lin(rows, schedule=None):
        return triton_ops.bi_linear(rows, w, b, config=cfg, schedule=schedule)

    full = lin(x)  # "seq": 48 tiles > par_max_tiles
    for M in MS:
        assert torch.equal(lin(x[:M], "par"), full[:M]), M
        # the same rows in reverse order, through the other schedule
        assert torch.equal(lin(x[:M].flip(0), "seq"), full[:M].flip(0)), M
        # row 0 placed last among unrelated rows, automatic schedule
        others = torch.cat([_rand(M - 1, K, dtype=dtype, seed=M), x[:1]])
        assert torch.equal(lin(others)[-1], full[0]), M


@pytest.mark.parametrize("name", ["ptr-flat-fused", "tma-nested-kernel", "one-split"])
def test_linear_matches_float64(name):
    cfg = CONFIGS[name]
    K, N = 256, 96
    x, w, b = _rand(17, K), _rand(N, K, seed=1), _rand(N, seed=2)
    ref = x.double().cpu() @ w.double().cpu().T + b.double().cpu()
    for schedule in ("par", "seq"):
        assert _rel(triton_ops.bi_linear(x, w, b, config=cfg, schedule=schedule), ref) <= 1e-5
    assert _rel(triton_ops.bi_linear(x, w, None, config=cfg), ref - b.double().cpu()) <= 1e-5
    xb, wb = x.bfloat16(), w.bfloat16()
    ref_b = xb.double().cpu() @ wb.double().cpu().T
    assert _rel(triton_ops.bi_linear(xb, wb, config=cfg), ref_b) <= 1e-2


def test_linear_default_table_and_leading_dims():
    x, w = _rand(2, 3, 128), _rand(48, 128, seed=1)
    out = triton_ops.bi_linear(x, w)
    assert out.shape == (2, 3, 48)
    assert _rel(out, x.double().cpu() @ w.double().cpu().T) <= 1e-5
    assert triton_ops.bi_linear(x[:0].reshape(0, 128), w).shape == (0, 48)


def _rms_ref(x, w, eps, r=None):
    z = (x + r) if r is not None else x
    z = z.double().cpu()
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()


@pytest.mark.parametrize("chunk", [None, 64])  # 64: a row spans several chunks (the long-row path)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype, with_residual, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(triton_norm, "_MAX_BLOCK", chunk)
    H, eps = 200, 1e-6
    x, w = _rand(64, H, dtype=dtype), (_rand(H, seed=1).abs() + 0.5).to(dtype)
    r = _rand(64, H, dtype=dtype, seed=2) if with_residual else None
    full = triton_ops.bi_rms_norm(x, w, eps, r)
    for M in MS:
        part = triton_ops.bi_rms_norm(x[:M].flip(0), w, eps, r[:M].flip(0) if with_residual else None)
        if with_residual:
            assert torch.equal(part[0], full[0][:M].flip(0)) and torch.equal(part[1], full[1][:M].flip(0))
        else:
            assert torch.equal(part, full[:M].flip(0)), M
    out = full[0] if with_residual else full
    if with_residual:  # new residual = x + residual rounded to the model dtype
        if DEV == "cuda":
            assert torch.equal(full[1], x + r)
        else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: 1 ulp
            torch.testing.assert_close(full[1], x + r, rtol=2**-7, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(out, _rms_ref(full[1] if with_residual else x, w, eps)) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax(dtype):
    V = 5000  # two 4096-wide chunks, the second partial
    x = (_rand(64, V, seed=3) * 6).to(dtype)
    x[5, :2000] = float("-inf")  # lanes that only ever see -inf must not turn the row into NaN
    full = triton_ops.bi_log_softmax(x)
    assert full.dtype == torch.float32
    for M in MS:
        assert torch.equal(triton_ops.bi_log_softmax(x[:M].flip(0)), full[:M].flip(0)), M
    ref = torch.log_softmax(x.double().cpu(), -1)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(full.cpu()))
    err = (full.cpu().double()[finite] - ref[finite]).abs().max().item()
    assert err <= 1e-5 * ref[finite].abs().max().item()


def test_greedy_log_softmax_is_log_softmax_at_the_argmax():
    """Deterministic greedy decoding's one read: the same token as torch.argmax and the same
    logprob bits as bi_log_softmax's entry there, on ties, NaN and all -inf rows too."""
    V = 5000  # two 4096-wide chunks, the second partial
    x = _rand(24, V, seed=4) * 6
    x[1, 4500] = x[1, 17] = x[1].max() + 1  # a tie: the first index wins
    x[2, 3] = x[2, 4097] = float("nan")  # a NaN wins, the first one
    x[3] = float("-inf")  # nothing finite: index 0, NaN logprob (log_softmax's)
    x[4, :4096] = float("-inf")  # lanes that only see -inf in the first chunk
    x[5, 4096 + 7] = 1e4  # the maximum in the partial chunk
    ids, logprobs = triton_ops.bi_greedy_log_softmax(x)
    want_ids = torch.argmax(x, dim=-1)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert ids[1] == 17 and ids[2] == 3 and ids[3] == 0 and ids[5] == 4096 + 7
    want = triton_ops.bi_log_softmax(x).gather(-1, want_ids[:, None])[:, 0]
    assert torch.equal(logprobs.isnan(), want.isnan()) and logprobs[3].isnan()
    ok = ~want.isnan()
    assert torch.equal(logprobs[ok], want[ok])  # bit for bit
    for M in (1, 3, 17):  # a row's result never depends on the batch
        sub_ids, sub = triton_ops.bi_greedy_log_softmax(x[:M].flip(0).contiguous())
        assert torch.equal(sub_ids, ids[:M].flip(0)) and torch.equal(sub[~sub.isnan()], logprobs[:M].flip(0)[~sub.isnan()])
    with pytest.raises(TypeError, match="float32"):
        triton_ops.bi_greedy_log_softmax(x.bfloat16())


def test_m_tiers_change_only_the_tile():
    key = (72, 200, torch.float32)
    saved = dict(triton_ops.M_TIERS)
    try:
        triton_ops.set_config(*key, triton_matmul.MatmulConfig(**BASE, use_tma=False))
        triton_ops.set_m_tiers(*key, ((40, dict(block_m=64)), (17, dict(block_m=32, num_warps=8))))
        small, mid, large = (triton_ops.matmul_config(*key, M=m) for m in (16, 17, 40))
        assert (small.block_m, mid.block_m, mid.num_warps, large.block_m, large.num_warps) == (16, 32, 8, 64, 4)
        assert {(c.split_k, c.dot_precision) for c in (small, mid, large)} == {(64, "ieee")}
        assert triton_ops.matmul_config(*key) == small  # no M: the table entry itself
        x, w = _rand(41, 200), _rand(72, 200, seed=1)
        full = triton_ops.bi_linear(x, w)  # M=41: the last tier's tile
        assert torch.equal(triton_ops.bi_linear(x[:16], w), full[:16]) or DEV == "cpu"
        triton_ops.set_m_tiers(*key, ((17, dict(block_m=32)), (40, {})))  # {}: the table tile again
        assert triton_ops.matmul_config(*key, M=40) == triton_ops.matmul_config(*key)
        assert triton_ops.matmul_config(*key, M=17).block_m == 32
        triton_ops.set_m_tiers(*key, ((17, dict(par_max_tiles=1)),))  # a tier may force "seq"
        seq = triton_ops.matmul_config(*key, M=17)
        assert triton_matmul.choose_schedule(17, 72, 200, seq, x.device) == "seq"
        x_seq = triton_ops.bi_linear(x[:17], w)
        assert torch.equal(x_seq, triton_ops.bi_linear(x[:17], w, config=seq, schedule="par"))
        with pytest.raises(ValueError, match="split_k"):
            triton_ops.set_m_tiers(*key, ((17, dict(split_k=128)),))
        with pytest.raises(ValueError, match="multiple of block_k"):
            triton_ops.set_m_tiers(*key, ((17, dict(block_k=48)),))
    finally:
        triton_ops.M_TIERS.clear()
        triton_ops.M_TIERS.update(saved)
        triton_ops.CONFIG_TABLE.pop((72, 200, "fp32"), None)
