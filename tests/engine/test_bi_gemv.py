"""bi_gemv (deterministic mode's opt-in small-batch linears, engine/kernels/bi_gemv.py), at small
sizes under Triton's CPU interpreter: its K splits are the batch-invariant matmul's, shapes it cannot
split that way keep the matmul, and its rows are close to the matmul's. Bit for bit is a property
of the GPU's tensor cores (tests/gpu/test_batch_invariant_gpu.py); the interpreter's numpy sums
group other ways. Skipped where Triton is not installed and on CUDA machines."""

from __future__ import annotations

import os

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.kernels import bi_gemv  # noqa: E402
from engine.kernels.batch_invariant import triton_ops  # noqa: E402

BF = torch.bfloat16
# Qwen3-8B (qkv, o, gate_up, down): their table splits are 2048, 1024, 2048, 2048 keys
SHAPES_8B = {(6144, 4096): 2, (4096, 4096): 4, (24576, 4096): 2, (4096, 12288): 6}


@pytest.mark.parametrize("shape", list(SHAPES_8B))
def test_the_gemv_splits_k_where_the_matmul_does(shape):
    n, k = shape
    cfg = bi_gemv.config(n, k, BF)
    matmul = triton_ops.matmul_config(n, k, BF)
    assert cfg.split_k == SHAPES_8B[shape] == matmul.num_splits(k)
    assert cfg.split_k * matmul.split_k == k and matmul.split_k % cfg.block_k == 0  # the same boundaries


def test_shapes_it_cannot_split_alike_keep_the_matmul(monkeypatch):
    assert bi_gemv.config(151936, 4096, BF).split_k == 1  # one split (the LM head's table entry)
    monkeypatch.setattr(triton_ops, "CONFIG_TABLE", {})
    assert bi_gemv.config(1000, 3000, BF) is None  # the default rule's 1024-key splits: 3000 is no multiple
    monkeypatch.setitem(triton_ops.CONFIG_TABLE, (64, 256, "bf16"), triton_ops.MatmulConfig(block_k=32, split_k=64))
    assert bi_gemv.config(64, 256, BF) is None  # a split of 64 keys: not a whole number of the gemv's k steps
    monkeypatch.setattr(bi_gemv, "ENABLED", True)
    x, w = torch.zeros(1, 3000, dtype=BF), torch.zeros(1000, 3000, dtype=BF)
    with torch.inference_mode():
        assert not bi_gemv.applies(x, w)
        with pytest.raises(ValueError, match="no gemv split"):
            bi_gemv.bi_gemv(x, w)


def test_on_by_default_and_close_to_the_matmul(monkeypatch):
    assert bi_gemv.ENABLED == (os.environ.get("TANDEM_DET_GEMV", "1") == "1")
    g = torch.Generator().manual_seed(0)
    n, k = 96, 512
    monkeypatch.setattr(triton_ops, "CONFIG_TABLE", {(n, k, "bf16"): triton_ops.MatmulConfig(split_k=256)})
    x = torch.randn(3, k, generator=g).to(BF)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(BF)
    b = torch.randn(n, generator=g).to(BF)
    monkeypatch.setattr(bi_gemv, "ENABLED", True)
    with torch.inference_mode():
        assert bi_gemv.applies(x, w) and bi_gemv.config(n, k, BF).split_k == 2
        got = bi_gemv.bi_gemv(x, w, b)
    want = triton_ops.bi_linear(x, w, b)
    torch.testing.assert_close(got, want, atol=0.0, rtol=0.008)  # an ulp: the interpreter's sums group otherwise


def test_the_add_norm_stays_after_a_sum_over_ranks(monkeypatch):
    """A linear whose output is summed over tensor-parallel ranks (small_m_epilogue off, as
    RowParallelLinear) keeps its add + norm after that sum: never the gemv's epilogue."""
    from engine.models import layers

    n, k = 64, 256
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(bi_gemv, "ENABLED", True)
    monkeypatch.setitem(triton_ops.CONFIG_TABLE, (n, k, "bf16"), triton_ops.MatmulConfig(split_k=128))
    lin = layers.Linear(k, n, bias=False, deterministic=True).to(BF)
    norm = layers.RMSNorm(n, deterministic=True).to(BF)
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, k, generator=g).to(BF), torch.randn(2, n, generator=g).to(BF)
    taken = []
    real = bi_gemv.bi_gemv_add_norm
    monkeypatch.setattr(bi_gemv, "bi_gemv_add_norm", lambda *a: taken.append(1) or real(*a))
    with torch.inference_mode():
        lin.forward_add_norm(x, residual, norm)
        assert taken  # a plain Linear takes the epilogue
        lin.small_m_epilogue = False
        taken.clear()
        lin.forward_add_norm(x, residual, norm)
        assert not taken
