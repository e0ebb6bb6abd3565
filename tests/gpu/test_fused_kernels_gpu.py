"""The fused qk_norm_rope and silu_and_mul kernels on the GPU: bitwise against the unfused CUDA
path they replace, at the Qwen3-0.6B and Qwen3-8B head shapes, in bf16 (fp32/fp16 at one size).

The unfused CUDA path of q/k is bi.rms_norm (triton_norm) per head, then layers.apply_rotary; of
the activation, bi.silu_and_mul (deterministic mode) or F.silu(gate) * up (normal mode).
Against the pure torch norm (torch's CUDA mean, another summation order) only a bound holds.
Speed: scripts/fused_kernels_bench.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.testing.triton_for_tests import import_compiled_triton_or_skip

pytestmark = pytest.mark.gpu
triton = import_compiled_triton_or_skip()

HEADS = {"qwen3-0.6b": (16, 8), "qwen3-8b": (32, 8)}  # (q heads, kv heads), head_dim 128
INTERMEDIATE = {"qwen3-0.6b": 3072, "qwen3-8b": 12288}
D, EPS = 128, 1e-6
TS = (1, 7, 256, 4096)


def _case(T, shape, dtype=torch.bfloat16, seed=0):
    H, Hkv = HEADS[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, device="cuda", generator=g) * 2).to(dtype)
    weights = [(torch.rand(D, device="cuda", generator=g) + 0.5).to(dtype) for _ in range(2)]
    from engine.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(D, 1e6).cuda()
    cos, sin = rope(torch.randint(0, 40000, (T,), device="cuda", generator=g))
    return qkv, weights, cos, sin


def _views(qkv, shape):
    H, Hkv = HEADS[shape]
    T = qkv.shape[0]
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, H, D), k.view(T, Hkv, D)


def _unfused(q, k, cos, sin, weights):
    from engine.kernels import batch_invariant as bi
    from engine.models.layers import apply_rotary

    if weights is not None:
        q, k = bi.rms_norm(q, weights[0], EPS), bi.rms_norm(k, weights[1], EPS)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("shape", list(HEADS))
@pytest.mark.parametrize("T", TS)
def test_qk_norm_rope_bitwise(T, shape, with_norm):
    from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    qkv, weights, cos, sin = _case(T, shape, seed=T)
    weights = weights if with_norm else None
    last = qkv[-1:].clone()
    with torch.inference_mode():
        q, k = _views(qkv, shape)
        ref_q, ref_k = _unfused(q, k, cos, sin, weights)
        torch_q, torch_k = qk_norm_rope_reference(q, k, cos, sin, *(weights or [None, None]), EPS)
        v_before = qkv[:, q.shape[1] * D + k.shape[1] * D:].clone()
        out_q, out_k = qk_norm_rope(q, k, cos, sin, *(weights or [None, None]), EPS)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, q.shape[1] * D + k.shape[1] * D:], v_before)
    with torch.inference_mode():  # a row's bits do not depend on the batch
        q1, k1 = qk_norm_rope(*_views(last, shape), cos[-1:], sin[-1:], *(weights or [None, None]), EPS)
    assert torch.equal(q1[0], out_q[-1]) and torch.equal(k1[0], out_k[-1])
    # the pure torch norm sums in another order: an ulp of the rsqrt argument, bf16 rounding
    for o, r in ((out_q, torch_q), (out_k, torch_k)):
        torch.testing.assert_close(o, r, rtol=2**-7, atol=2**-7 * r.abs().max().item())


@pytest.mark.parametrize("shape", list(HEADS))
@pytest.mark.parametrize("T", [1, 7, 4096])
def test_qk_norm_rope_stores_kv_as_store_kv_does(T, shape):
    """kv_cache: the launch that norms and rotates q/k also writes k and v into their pool slots,
    bit for bit what store_kv writes after the unfused kernel; q and k unchanged by it."""
    from engine.kernels.qk_norm_rope import qk_norm_rope
    from engine.kernels.store_kv import store_kv

    qkv, weights, cos, sin = _case(T, shape, seed=T + 1)
    H, Hkv = HEADS[shape]
    pools = [torch.zeros(T + 64, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    loc = torch.randperm(T + 63, device="cuda")[:T] + 1
    with torch.inference_mode():
        ref_qkv = qkv.clone()
        rq, rk = qk_norm_rope(*_views(ref_qkv, shape), cos, sin, *weights, EPS)
        store_kv(rk, ref_qkv[:, (H + Hkv) * D:].view(T, Hkv, D), pools[2], pools[3], loc)
        q, k = _views(qkv, shape)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, EPS, kv_cache=(v, pools[0], pools[1], loc))
    assert torch.equal(out_q, rq) and torch.equal(out_k, rk)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(pools[0][loc], out_k) and not pools[0][0].any()  # the padding slot untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope_other_dtypes(dtype):
    from engine.kernels.qk_norm_rope import qk_norm_rope

    qkv, weights, cos, sin = _case(7, "qwen3-8b", dtype)
    with torch.inference_mode():
        q, k = _views(qkv, "qwen3-8b")
        ref = _unfused(q, k, cos, sin, weights)
        out = qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_grad(with_norm):
    from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    qkv, weights, cos, sin = _case(256, "qwen3-0.6b")
    weights = [w.requires_grad_(True) for w in weights] if with_norm else [None, None]
    qkv.requires_grad_(True)
    q, k = _views(qkv, "qwen3-0.6b")
    out = qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert out[0].data_ptr() != q.data_ptr()  # out of place under autograd
    grads = [torch.randn_like(o) for o in out]
    params = [qkv] + [w for w in weights if w is not None]
    got = torch.autograd.grad(out, params, grads)
    ref = torch.autograd.grad(qk_norm_rope_reference(q, k, cos, sin, *weights, EPS), params, grads)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # backward is the reference's autograd
    with torch.no_grad():
        in_place = qk_norm_rope(*(t.detach().clone() for t in (q, k)), cos, sin,
                                *[w.detach() if w is not None else None for w in weights], EPS)
    assert torch.equal(out[0], in_place[0]) and torch.equal(out[1], in_place[1])


@pytest.mark.parametrize("stepwise", [True, False])
@pytest.mark.parametrize("shape", list(INTERMEDIATE))
@pytest.mark.parametrize("T", TS)
def test_silu_and_mul_bitwise(T, shape, stepwise):
    from engine.kernels import batch_invariant as bi
    from engine.kernels.silu_and_mul import silu_and_mul

    d = INTERMEDIATE[shape]
    g = torch.Generator(device="cuda").manual_seed(T)
    x = (torch.randn(T, 2 * d, device="cuda", generator=g) * 3).bfloat16()
    with torch.inference_mode():
        out = silu_and_mul(x, stepwise)
        ref = bi.silu_and_mul(x) if stepwise else F.silu(x[:, :d]) * x[:, d:]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_other_dtypes(dtype):
    from engine.kernels import batch_invariant as bi
    from engine.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(7, 2 * 3072, device="cuda", dtype=dtype) * 3
    assert torch.equal(silu_and_mul(x, True), bi.silu_and_mul(x))
    assert torch.equal(silu_and_mul(x, False), F.silu(x[:, :3072]) * x[:, 3072:])


@pytest.mark.parametrize("stepwise", [True, False])
def test_silu_and_mul_grad(stepwise):
    from engine.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference

    x = (torch.randn(256, 2 * 3072, device="cuda") * 3).bfloat16().requires_grad_(True)
    grad = torch.randn(256, 3072, device="cuda").bfloat16()
    (got,) = torch.autograd.grad(silu_and_mul(x, stepwise), x, grad)
    (ref,) = torch.autograd.grad(silu_and_mul_reference(x, stepwise), x, grad)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
