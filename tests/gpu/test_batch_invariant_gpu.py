"""Batch-invariant Triton kernels on the GPU, at the Qwen3-8B shapes in bf16.

Every row at M in MS is bitwise the row computed at M=4096 (the Ms cross the "par"/"seq" schedule
switch and every M tier's tile switch), also reversed and through both schedules; the M=4096 result
is within bf16 tolerance of an fp32 reference. Speed is measured by scripts/bi_matmul_bench.py, not here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.testing.triton_for_tests import import_compiled_triton_or_skip

pytestmark = pytest.mark.gpu
triton = import_compiled_triton_or_skip()

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
MS = (1, 8, 16, 32, 48, 64, 65, 96, 128, 129, 160, 193, 224, 256, 257, 320, 321, 385, 448, 513, 640, 1024,
      2048)  # crosses the schedule and every tier switch


def _ops():
    from engine.kernels.batch_invariant import triton_ops

    return triton_ops


@pytest.mark.parametrize("name", list(SHAPES))
def test_linear_bitwise_across_m(name):
    ops = _ops()
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    x = torch.randn(4096, K, device="cuda", generator=g).bfloat16()
    full = ops.bi_linear(x, w)
    torch.cuda.synchronize()
    cfg = ops.matmul_config(N, K, torch.bfloat16)
    for M in MS:
        assert torch.equal(ops.bi_linear(x[:M], w), full[:M]), (name, M)
        assert torch.equal(ops.bi_linear(x[:M].flip(0), w), full[:M].flip(0)), (name, M)
        if cfg.num_splits(K) > 1:
            for schedule in ("par", "seq"):
                assert torch.equal(ops.bi_linear(x[:M], w, schedule=schedule), full[:M]), (name, M, schedule)
    ref = F.linear(x.float(), w.float())
    rel = ((full.float() - ref).norm() / ref.norm()).item()
    assert rel < 8e-3, rel  # bf16 output rounding alone is ~3e-3


def test_linear_bias_and_fp32():
    ops = _ops()
    x, w, b = (torch.randn(*s, device="cuda") for s in ((300, 1024), (512, 1024), (512,)))
    ref = x.double() @ w.double().T + b.double()
    out = ops.bi_linear(x, w, b)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5
    assert torch.equal(ops.bi_linear(x[:1], w, b), out[:1])
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    outb = ops.bi_linear(xb, wb, bb)
    assert torch.equal(ops.bi_linear(xb[7:8], wb, bb), outb[7:8])


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bitwise_and_close(with_residual):
    ops = _ops()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x) if with_residual else None
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    full = ops.bi_rms_norm(x, w, 1e-6, r)
    for M in (1, 8, 256):
        part = ops.bi_rms_norm(x[:M].flip(0), w, 1e-6, r[:M].flip(0) if with_residual else None)
        if with_residual:
            assert torch.equal(part[0], full[0][:M].flip(0)) and torch.equal(part[1], full[1][:M].flip(0))
        else:
            assert torch.equal(part, full[:M].flip(0))
    out = full[0] if with_residual else full
    z = (x + r) if with_residual else x
    if with_residual:
        assert torch.equal(full[1], z)
    zf = z.float()
    ref = (zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float() * w.float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 4e-3


def test_log_softmax_bitwise_and_close():
    ops = _ops()
    logits = torch.randn(512, 151936, device="cuda", dtype=torch.bfloat16) * 4
    full = ops.bi_log_softmax(logits)
    for M in (1, 8, 256):
        assert torch.equal(ops.bi_log_softmax(logits[:M].flip(0)), full[:M].flip(0))
    ref = torch.log_softmax(logits.double(), -1)
    assert (full.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_greedy_log_softmax_is_log_softmax_at_the_argmax(rows):
    """Deterministic greedy decoding's fused read: torch.argmax's token and bi_log_softmax's
    bits at it, at Qwen3's vocabulary, on bf16-valued logits (ties likely) widened to float32."""
    ops = _ops()
    V = 151936
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, V, device="cuda", generator=g) * 4).bfloat16().float()
    x[0, 100_000] = x[0, 5] = x[0].max() + 1  # a tie, far apart: the first wins
    ids, logprobs = ops.bi_greedy_log_softmax(x)
    want_ids = torch.argmax(x, dim=-1)
    assert torch.equal(ids, want_ids) and ids[0] == 5
    assert torch.equal(logprobs, ops.bi_log_softmax(x).gather(-1, want_ids[:, None])[:, 0])
    if rows > 1:  # the batch never changes a row
        sub_ids, sub = ops.bi_greedy_log_softmax(x[1:].flip(0).contiguous())
        assert torch.equal(sub_ids, ids[1:].flip(0)) and torch.equal(sub, logprobs[1:].flip(0))


@pytest.mark.parametrize("graph", [False, True])
def test_linear_chain_at_few_rows_reads_finished_inputs(graph):
    """At a few rows the matmul is launched with PDL (engine/kernels/pdl.py): each one in a chain
    must read its predecessor's finished output (through both schedules, eagerly and replayed from
    a CUDA graph), so the chain's rows are bitwise the same chain run at M = 4096."""
    ops = _ops()
    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(4096, 4096, device="cuda", generator=g) * 4096**-0.5).bfloat16() for _ in range(6)]
    x = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()

    def chain(h, schedule=None):
        for w in ws:
            h = ops.bi_rms_norm(ops.bi_linear(h, w, schedule=schedule), torch.ones_like(w[0]), 1e-6)
        return h

    full = chain(x)
    for M in (1, 3, 8):
        for schedule in ("par", "seq"):
            rows = x[:M].clone()
            if graph:
                chain(rows, schedule)  # compiled before capture
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    out = chain(rows, schedule)
                for _ in range(3):
                    captured.replay()
            else:
                out = chain(rows, schedule)
            assert torch.equal(out, full[:M]), (M, schedule, graph)


@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_det_gemv_gives_the_matmuls_bits(name, monkeypatch):
    """engine/kernels/bi_gemv.py (TANDEM_DET_GEMV, on by default): the small-M gemv run with the matmul's K splits
    gives bi_linear's rows bit for bit at 1..32 rows (past 16 its 32-row tile), so the rows the
    M = 4096 matmul gives."""
    from engine.kernels import bi_gemv

    ops = _ops()
    monkeypatch.setattr(bi_gemv, "ROWS", 32)
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    x = torch.randn(4096, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(N, device="cuda", generator=g).bfloat16()
    full = ops.bi_linear(x, w, b)
    monkeypatch.setattr(bi_gemv, "ENABLED", True)
    with torch.inference_mode():
        wide = name in ("qkv", "gate_up")  # the gemv takes them under TANDEM_PDL=wide, to PDL's 8 rows
        for M in (1, 2, 3, 5, 8, 12, 16, 17, 24, 32):
            assert bi_gemv.applies(x[:M], w, wide=wide) == (M <= 8 or not wide), (name, M)
            assert torch.equal(bi_gemv.bi_gemv(x[:M], w, b), full[:M]), (name, M)  # (its bits at any M)


@pytest.mark.parametrize("name", ["o", "down"])
def test_det_gemv_add_norm_gives_the_batch_invariant_bits(name, monkeypatch):
    """bi_gemv_add_norm: o_proj's / down_proj's gemv with the add + norm in its split-K sum gives
    bi_rms_norm(bi_linear(x), residual)'s two outputs bit for bit at 1..32 rows."""
    from engine.kernels import bi_gemv

    ops = _ops()
    monkeypatch.setattr(bi_gemv, "ROWS", 32)
    N, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
    x = torch.randn(32, K, device="cuda", generator=g).bfloat16()
    residual = torch.randn(32, N, device="cuda", generator=g).bfloat16() * 4
    norm_w = torch.rand(N, device="cuda", generator=g).bfloat16() + 0.5
    monkeypatch.setattr(bi_gemv, "ENABLED", True)
    with torch.inference_mode():
        for M in (1, 3, 8, 20, 32):
            assert bi_gemv.applies_add_norm(x[:M], w), (name, M)
            want = ops.bi_rms_norm(ops.bi_linear(x[:M], w), norm_w, 1e-6, residual[:M])
            got = bi_gemv.bi_gemv_add_norm(x[:M], w, None, residual[:M], norm_w, 1e-6)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (name, M)
