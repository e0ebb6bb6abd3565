"""small_m_linear, greedy_logprob and gumbel_argmax under Triton's CPU interpreter, small sizes,
against a float64 reference or the eager torch function they replace (the GPU runs them in
tests/gpu/test_decode_kernels_gpu.py).
Skipped where triton is absent and on CUDA machines."""

from __future__ import annotations

import os

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.kernels import greedy_logprob as gl  # noqa: E402
from engine.kernels import gumbel_argmax as ga  # noqa: E402
from engine.kernels import token_bitmask as tb  # noqa: E402
from engine.kernels.small_m_linear import GemvConfig, choose_config, small_m_linear  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 8, 20, 32])  # past 16 rows: the 32-row tile
@pytest.mark.parametrize("config", [None, GemvConfig(32, 32, 1), GemvConfig(16, 32, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_m_linear_matches_float64(m, config, bias):
    g = torch.Generator().manual_seed(m)
    n, k = 80, 128  # n not a multiple of the tile: the masked edge
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = small_m_linear(x, w, b, config)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=0.08, rtol=0.01)  # bf16 output rounding
    assert torch.equal(out, small_m_linear(x, w, b, config))  # the same bits run to run


def test_small_m_linear_strided_rows_and_refusals():
    x = torch.randn(2, 96).to(torch.float16)[:, :64]  # rows 96 apart, last dim contiguous
    w = torch.randn(48, 64).to(torch.float16)
    torch.testing.assert_close(small_m_linear(x, w).double(), x.double() @ w.double().T, atol=0.02, rtol=0.01)
    with pytest.raises(ValueError, match="small_m_linear"):
        small_m_linear(torch.randn(33, 64).half(), w)  # past MAX_M
    with pytest.raises(ValueError, match="small_m_linear"):
        small_m_linear(torch.randn(1, 32).half(), w)


def test_choose_config_splits_k_evenly_for_few_programs():
    cfg = choose_config(1024, 3072)  # 16 column programs: K split up to ~2 programs per SM
    assert cfg.split_k > 1 and (3072 // cfg.block_k) % cfg.split_k == 0
    assert choose_config(4096, 4096).split_k == 2  # 64 column programs: 2 splits of 16 K steps
    assert choose_config(1024, 128).split_k == 1  # one K step: nothing to split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_logprob_matches_torch(dtype, monkeypatch):
    monkeypatch.setattr(gl, "CHUNK", 64)  # several chunks per row at a small vocab
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 4).to(dtype)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie across chunks: the first wins
    logits[2, :] = 0.0  # all equal: index 0
    ids, lp = gl.greedy_logprob(logits)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(ids, torch.argmax(logits.float(), dim=-1)) and ids[1] == 7 and ids[2] == 0
    torch.testing.assert_close(lp.double(), ref.gather(1, ids[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32


def test_engine_linear_takes_small_m_kernel_and_trainer_keeps_cublas(monkeypatch):
    from engine.models import layers
    from engine.kernels import small_m_linear as sml

    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)  # the interpreter stands in for CUDA
    calls = []
    real = sml.small_m_linear
    monkeypatch.setattr(sml, "small_m_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    lin = layers.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = lin(x)
        torch.testing.assert_close(out.double(), torch.nn.functional.linear(x, lin.weight, lin.bias).double(),
                                   atol=0.05, rtol=0.01)
        assert calls == [(2, 64)]
        lin(torch.randn(sml.ROWS + 1, 64).to(torch.bfloat16))  # over normal mode's rows: cuBLAS
        layers.Linear(48, 64).to(torch.bfloat16)(torch.randn(2, 48).to(torch.bfloat16))  # wider out: cuBLAS
        lin(torch.randn(64, 2).to(torch.bfloat16).T)  # a transposed view: cuBLAS takes any strides
        assert len(calls) == 1
        layers.use_autograd_ops(lin)  # a normal-mode trainer: cuBLAS whatever the rows
        lin(x)
        assert len(calls) == 1


def test_greedy_logprob_rows_without_a_finite_logit(monkeypatch):
    """All NaN, all -inf, a NaN in a one-chunk row: torch's argmax id and a NaN logprob (never +inf)."""
    monkeypatch.setattr(gl, "CHUNK", 64)
    logits = torch.randn(4, 100)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, 30] = float("nan")
    ids, lp = gl.greedy_logprob(logits)
    assert torch.equal(ids[:3], torch.argmax(logits[:3], dim=-1))
    assert torch.isnan(lp[:3]).all() and torch.isfinite(lp[3])


def test_small_m_linear_not_under_grad_mode(monkeypatch):
    from engine.kernels import small_m_linear as sml

    x, w = torch.randn(2, 64).to(torch.bfloat16), torch.randn(48, 64).to(torch.bfloat16)
    assert not sml.applies(x, w)  # grad mode on: a trainable bias would lose its gradient
    with torch.no_grad():
        assert sml.applies(x, w)


def test_rows_taken_follow_each_modes_limit(monkeypatch):
    """Normal mode sends up to TANDEM_GEMV_MAX_M rows, deterministic mode up to TANDEM_DET_GEMV_MAX_M
    (8 and 32 unless set); the kernel takes 32 at most, a wide linear (qkv, gate_up) only as far as
    PDL goes, and a row's bits do not depend on the tile."""
    from engine.kernels import bi_gemv
    from engine.kernels import small_m_linear as sml

    if "TANDEM_GEMV_MAX_M" not in os.environ and "TANDEM_DET_GEMV_MAX_M" not in os.environ:
        assert (sml.ROWS, bi_gemv.ROWS) == (8, 32)
    x, w = torch.randn(sml.MAX_M + 1, 64).to(torch.bfloat16), torch.randn(48, 64).to(torch.bfloat16)
    wide = torch.randn(192, 64).to(torch.bfloat16)
    monkeypatch.setattr(sml, "WIDE_PDL", True)
    with torch.no_grad():
        assert sml.applies(x[:sml.ROWS], w) and not sml.applies(x[:sml.ROWS + 1], w)
        assert bi_gemv.applies(x[:bi_gemv.ROWS], w) and not bi_gemv.applies(x[:bi_gemv.ROWS + 1], w)
        assert sml.applies(x[:32], w, max_rows=32) and not sml.applies(x, w, max_rows=33)
        assert sml.applies(x[:8], wide, wide=True, max_rows=32) and not sml.applies(x[:9], wide, wide=True, max_rows=32)
        monkeypatch.setattr(sml, "ROWS", 16)  # read at each call, as bi_gemv's
        assert sml.applies(x[:16], w) and not sml.applies(x[:17], w)
        full, few = sml.small_m_linear(x[:32], w), sml.small_m_linear(x[:5], w)  # 32- and 16-row tiles
    assert torch.equal(full[:5], few)
    with pytest.raises(ValueError, match="small_m_linear"):
        sml.small_m_linear(x, w)


def test_wide_linears_take_the_gemv_only_under_wide_pdl(monkeypatch):
    """qkv / gate_up (more outputs than inputs) stay with cuBLAS under TANDEM_PDL=1 or 0 and move
    to the gemv under wide (the default); other wide linears (an LM head) always stay."""
    from engine.kernels import pdl
    from engine.kernels import small_m_linear as sml

    assert sml.WIDE_PDL == (pdl.MODE == "wide")
    x, wide = torch.randn(1, 64).to(torch.bfloat16), torch.randn(192, 64).to(torch.bfloat16)
    with torch.no_grad():
        monkeypatch.setattr(sml, "WIDE_PDL", False)
        assert not sml.applies(x, wide) and not sml.applies(x, wide, wide=True)
        monkeypatch.setattr(sml, "WIDE_PDL", True)
        assert sml.applies(x, wide, wide=True) and not sml.applies(x, wide)
        torch.testing.assert_close(sml.small_m_linear(x, wide).float(), x.float() @ wide.float().T,
                                   rtol=1e-2, atol=1e-2)


def test_gemv_prefetch_lines_cover_the_slice_within_the_l2_budget(monkeypatch):
    """Each program asks for its whole slice past the first tile (rounded up to a power of two of
    lines: the kernel clamps the extra addresses) while the grid stays within PREFETCH_BUDGET; past
    it, the largest power of two that fits; nothing when off or with nothing past the first tile."""
    from engine.kernels import pdl

    monkeypatch.setattr(pdl, "PREFETCH", True)
    assert pdl.prefetch_lines(128, 32, (1024 - 128) * 2) == 16  # 0.6B qkv: 14 lines, all of them
    assert pdl.prefetch_lines(64, 64, 384 * 2) == 8  # 6 lines
    lines = pdl.prefetch_lines(384, 64, (4096 - 128) * 2)  # 8B gate_up: 62 lines a row, 201 MB in all
    assert lines == 4 and 384 * 64 * lines * pdl.L2_LINE <= pdl.PREFETCH_BUDGET < 384 * 64 * 2 * lines * pdl.L2_LINE
    assert pdl.prefetch_lines(64, 64, 0) == 0 and pdl.prefetch_lines(1 << 20, 64, 4096) == 0
    assert pdl.prefetch_lines(0, 64, 4096) == 0 and pdl.prefetch_lines(64, 64, -256) == 0  # empty shapes
    monkeypatch.setattr(pdl, "PREFETCH", False)
    assert pdl.prefetch_lines(128, 32, 1792) == 0


SEEDS = [0, -1, 2**62 + 12345, -(2**63), 7]  # both 32-bit halves, negative int64 patterns
POSITIONS = [0, 5, 2**40 + 3, 17, 2**31]


@pytest.mark.parametrize("vocab", [100, 300, 257])
def test_gumbel_argmax_takes_the_eager_references_tokens(vocab, monkeypatch):
    """The same int64 hash and float64 noise as engine.sampling.seeds: the same token per row,
    several chunks per row (a vocab not a multiple of CHUNK), extreme seeds and positions."""
    from engine.sampling.seeds import gumbel_argmax as eager

    monkeypatch.setattr(ga, "CHUNK", 64)
    g = torch.Generator().manual_seed(vocab)
    logprobs = torch.log_softmax(torch.randn(5, vocab, generator=g) * 2, dim=-1)
    seeds, positions = torch.tensor(SEEDS), torch.tensor(POSITIONS)
    ids = ga.gumbel_argmax(logprobs, seeds, positions)
    assert ids.dtype == torch.int64 and torch.equal(ids, eager(logprobs, seeds, positions))
    for row in range(5):  # a row's token does not depend on its batch
        assert ga.gumbel_argmax(logprobs[row:row + 1], seeds[row:row + 1], positions[row:row + 1]) == ids[row]


def test_gumbel_argmax_noise_order_is_the_references(monkeypatch):
    """Flat logprobs: the token is the noise's argmax; banning it in turn walks the noise's order,
    so the noise itself (not just its maximum) is the reference's."""
    from engine.sampling.seeds import gumbel_noise

    monkeypatch.setattr(ga, "CHUNK", 64)
    seeds, positions = torch.tensor([11, -99]), torch.tensor([1, 2**33])
    order = gumbel_noise(seeds, positions, 200).argsort(dim=-1, descending=True)
    logprobs = torch.zeros(2, 200)
    for k in range(8):
        ids = ga.gumbel_argmax(logprobs, seeds, positions)
        assert torch.equal(ids, order[:, k])
        logprobs[torch.arange(2), ids] = float("-inf")


def test_gumbel_argmax_nan_masked_and_empty_rows(monkeypatch):
    from engine.sampling.seeds import gumbel_argmax as eager

    monkeypatch.setattr(ga, "CHUNK", 64)
    logprobs = torch.zeros(3, 150)
    logprobs[0, 120] = float("nan")  # torch.argmax: a NaN wins
    logprobs[1] = float("-inf")  # nothing allowed: index 0, as torch
    logprobs[2, :140] = float("-inf")  # only the last chunk's tail allowed
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    ids = ga.gumbel_argmax(logprobs, seeds, positions)
    assert torch.equal(ids, eager(logprobs, seeds, positions)) and ids[0] == 120 and ids[1] == 0 and ids[2] >= 140
    assert ga.gumbel_argmax(torch.zeros(0, 150), seeds[:0], positions[:0]).shape == (0,)
    with pytest.raises(ValueError, match="contiguous"):
        ga.gumbel_argmax(torch.zeros(150, 3).T, seeds, positions)


def test_sampler_takes_the_triton_gumbel_kernel_unless_told_not_to(monkeypatch):
    from engine.sampling import sampler as sampler_mod

    monkeypatch.delenv("TANDEM_TRITON_GUMBEL", raising=False)
    assert sampler_mod._triton_gumbel_argmax() is ga.gumbel_argmax  # the default (measured, docs/benchmarks.md)
    monkeypatch.setenv("TANDEM_TRITON_GUMBEL", "0")
    assert sampler_mod._triton_gumbel_argmax() is None  # torch.compile's


@pytest.mark.parametrize("vocab", [70, 4096 + 33])  # within one word row's end; past one program's block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_logits_equals_the_torch_path(vocab, dtype):
    """The Triton pass gives the unpack + masked_fill path's values exactly, the sign bit (token
    31 of a word) included, on a strided logits view and a wider-than-needed bitmask."""
    from engine.sampling.token_mask import masked_logits_torch

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + 2
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # only bit 31 of the first word: token 31 allowed, 0..30 not
    logits = torch.randn(3, vocab + 5, generator=g).to(dtype)[:, :vocab]
    out = tb.masked_logits(logits, bitmask)
    assert out.dtype == dtype and torch.equal(out, masked_logits_torch(logits, bitmask[:, : (vocab + 31) // 32]))
    assert out[0, 31] == logits[0, 31] and torch.isinf(out[0, :31]).all()
    with pytest.raises(ValueError, match="does not cover"):
        tb.masked_logits(logits, bitmask[:, :1])
