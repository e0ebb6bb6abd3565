"""The fused qk_norm_rope and silu_and_mul Triton kernels under Triton's CPU interpreter, small sizes.

Bitwise against the torch code they replace, wherever the interpreter computes what the GPU
computes. Two places it cannot, each isolated here:
  * the fp32 sum of squares of the q/k norm: the interpreter's tl.sum is numpy's pairwise order,
    torch's CPU mean another vectorised order (on the GPU the kernel uses triton_norm's tree; tests/gpu
    check that bitwise). So: bitwise on data whose sum of squares is exact in any order; bitwise on
    random data against the torch code with numpy's sum; and a measured bound against plain torch.
  * exp (silu): the interpreter has no libdevice and uses numpy's exp, which differs from torch's
    CPU exp by an ulp. So: bitwise against the torch code with numpy's exp, and a bound.
Skipped where triton is absent (CI) and on CUDA machines (tests/gpu/test_fused_kernels_gpu.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
triton = pytest.importorskip("triton")
if type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference  # noqa: E402
from engine.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference  # noqa: E402
from engine.models import layers  # noqa: E402
from engine.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
H, HKV, EPS = 4, 2, 1e-6


def _qkv(T, D, dtype, seed, exact_sums=False):
    """q [T, H, D], k [T, HKV, D] as strided views of one qkv row block, as the model has them."""
    g = torch.Generator().manual_seed(seed)
    n = (H + 2 * HKV) * D
    if exact_sums:  # multiples of 1/16 below 4: every fp32 partial sum of squares is exact
        qkv = torch.randint(-63, 64, (T, n), generator=g) / 16.0
    else:
        qkv = torch.randn(T, n, generator=g) * 2
    qkv = qkv.to(dtype)
    q, k, _ = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    return qkv, q.view(T, H, D), k.view(T, HKV, D)


def _rope(T, D):
    return RotaryEmbedding(D, 10000.0)(torch.arange(T) * 37 + 5)  # float32 [T, D] each


def _weights(D, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2)]


def _torch_path(q, k, cos, sin, weights, sum_of_squares=None):
    """The model's CPU code: RMSNorm modules, then apply_rotary. sum_of_squares, if given, replaces
    the norm's fp32 sum (to isolate the reduction order); nothing else changes."""
    if weights is not None:
        outs = []
        for x, w in zip((q, k), weights):
            if sum_of_squares is None:
                norm = RMSNorm(x.shape[-1], EPS)
                norm.weight.data = w
                outs.append(norm(x))
            else:
                h = x.float()
                h = h * torch.rsqrt(sum_of_squares(h) / x.shape[-1] + EPS)
                outs.append(w * h.to(x.dtype))
        q, k = outs
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _numpy_sum(h):  # the interpreter's tl.sum over one row
    return torch.from_numpy(np.sum((h * h).numpy(), axis=-1, keepdims=True))


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_rope_only_bitwise_in_place(T, dtype, D):
    qkv, q, k = _qkv(T, D, dtype, seed=T * D)
    before = qkv.clone()
    cos, sin = _rope(T, D)
    ref_q, ref_k = _torch_path(q, k, cos, sin, None)
    out_q, out_k = qk_norm_rope(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, (H + HKV) * D:], before[:, (H + HKV) * D:])  # v untouched


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("pool_dtype", [None, torch.float32])
def test_kv_cache_store_in_the_same_launch(with_norm, pool_dtype):
    """kv_cache: the normed, rotated k and the untouched v land in their pool slots (cast to the
    pool's dtype) as store_kv would put them; q and k come out as without it; other slots keep
    their values."""
    from engine.kernels.store_kv import store_kv

    T, D, dtype = 5, 64, torch.bfloat16
    cos, sin = _rope(T, D)
    weights = _weights(D, dtype, seed=3) if with_norm else (None, None)
    qkv, q, k = _qkv(T, D, dtype, seed=11)
    v = qkv[:, (H + HKV) * D:].view(T, HKV, D)
    pools = [torch.full((12, HKV, D), 7.0, dtype=pool_dtype or dtype) for _ in range(4)]
    loc = torch.tensor([9, 2, 0, 11, 4])
    ref_q, ref_k = qk_norm_rope(q.clone(), k.clone(), cos, sin, *weights, EPS)
    store_kv(ref_k, v, pools[2], pools[3], loc)
    out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, EPS, kv_cache=(v, pools[0], pools[1], loc))
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(pools[1][loc].to(dtype), v) and (pools[0][[1, 3]] == 7.0).all()
    with pytest.raises(ValueError, match="kv_cache"):
        qk_norm_rope(q, k, cos, sin, *weights, EPS, kv_cache=(v, pools[0], pools[1], loc[:3]))


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_heads_a_program_change_no_bit(rows, monkeypatch):
    """TANDEM_QK_ROWS (from MIN_TOKENS_FOR_ROWS tokens): each program takes `rows` heads of one kind
    (3: a last group past the q / k / v heads' end, masked; 8: more than there are): q, k and the
    pool slots bit for bit as at one head a program; below the token threshold one head a program."""
    from engine.kernels import qk_norm_rope as qk_mod

    T, D, dtype = 5, 64, torch.bfloat16
    cos, sin = _rope(T, D)
    weights = _weights(D, dtype, seed=5)
    loc = torch.tensor([3, 8, 1, 6, 10])
    runs = []
    for r in (1, rows):
        monkeypatch.setattr(qk_mod, "ROWS", r)
        monkeypatch.setattr(qk_mod, "MIN_TOKENS_FOR_ROWS", 1)
        qkv, q, k = _qkv(T, D, dtype, seed=21)
        v = qkv[:, (H + HKV) * D:].view(T, HKV, D)
        pools = [torch.full((12, HKV, D), 7.0, dtype=dtype) for _ in range(2)]
        out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, EPS, kv_cache=(v, *pools, loc))
        runs.append((out_q, out_k, *pools, qkv))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    launched = []
    monkeypatch.setattr(qk_mod, "MIN_TOKENS_FOR_ROWS", T + 1)
    real = qk_mod._qk_norm_rope_kernel
    monkeypatch.setattr(qk_mod, "_qk_norm_rope_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    _, q, k = _qkv(T, D, dtype, seed=21)
    qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert launched == [(T, H + HKV)]  # one program a head: below the threshold


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_norm_rope_bitwise(T, dtype, D):
    cos, sin = _rope(T, D)
    weights = _weights(D, dtype, seed=D)
    # exact sums of squares: the torch path itself, bitwise
    _, q, k = _qkv(T, D, dtype, seed=T + D, exact_sums=True)
    ref = _torch_path(q, k, cos, sin, weights)
    out = qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # random data: bitwise once the sum is taken in the interpreter's order
    _, q, k = _qkv(T, D, dtype, seed=T * D)
    ref = _torch_path(q, k, cos, sin, weights, _numpy_sum)
    plain = _torch_path(q, k, cos, sin, weights)
    out = qk_norm_rope(q.clone(), k.clone(), cos, sin, *weights, EPS)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    # vs plain torch: a different fp32 sum moves inv by an ulp or so; measured at most 3.04 eps
    # (fp32, relative to the rotary terms |x_n cos| + |p_n sin|), 0.72 (fp16), 0 (bf16)
    for o, r, x, w in ((out[0], plain[0], q, weights[0]), (out[1], plain[1], k, weights[1])):
        xn = RMSNorm(D, EPS)
        xn.weight.data = w
        xn = xn(x).double()
        rot = torch.cat((-xn[..., D // 2:], xn[..., :D // 2]), dim=-1)
        scale = (xn * cos[:, None].double()).abs() + (rot * sin[:, None].double()).abs()
        assert ((o.double() - r.double()).abs() <= 4 * torch.finfo(dtype).eps * scale).all()


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_autograd_out_of_place(dtype, with_norm):
    T, D = 5, 64
    qkv, q, k = _qkv(T, D, dtype, seed=3)
    cos, sin = _rope(T, D)
    weights = _weights(D, dtype, seed=4) if with_norm else [None, None]
    qkv.requires_grad_(True)
    for w in weights:
        if w is not None:
            w.requires_grad_(True)
    q, k, _ = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, HKV, D)
    before = qkv.detach().clone()
    out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, EPS)
    assert out_q.data_ptr() != q.data_ptr() and torch.equal(qkv.detach(), before)  # inputs kept
    with torch.no_grad():  # same values as the in-place launch
        in_place = qk_norm_rope(q.detach().clone(), k.detach().clone(), cos, sin,
                                *[w.detach() if w is not None else None for w in weights], EPS)
    assert torch.equal(out_q, in_place[0]) and torch.equal(out_k, in_place[1])
    g = torch.Generator().manual_seed(9)
    gq, gk = torch.randn(out_q.shape, generator=g).to(dtype), torch.randn(out_k.shape, generator=g).to(dtype)
    params = [qkv] + [w for w in weights if w is not None]
    got = torch.autograd.grad((out_q, out_k), params, (gq, gk))
    ref = torch.autograd.grad(qk_norm_rope_reference(q, k, cos, sin, *weights, EPS), params, (gq, gk))
    for a, b in zip(got, ref):  # the backward is the reference's autograd: the same bits
        assert torch.equal(a, b)


def test_qk_norm_rope_grad_to_weights_only():
    T, D = 3, 32
    _, q, k = _qkv(T, D, torch.float32, seed=5)
    cos, sin = _rope(T, D)
    qw, kw = (w.requires_grad_(True) for w in _weights(D, torch.float32, seed=6))
    out = qk_norm_rope(q, k, cos, sin, qw, kw, EPS)
    assert out[0].data_ptr() != q.data_ptr()
    (out[0].sum() + 2 * out[1].sum()).backward()
    qw2, kw2 = (w.detach().clone().requires_grad_(True) for w in (qw, kw))
    ref = qk_norm_rope_reference(q, k, cos, sin, qw2, kw2, EPS)
    (ref[0].sum() + 2 * ref[1].sum()).backward()
    assert torch.equal(qw.grad, qw2.grad) and torch.equal(kw.grad, kw2.grad)


def _numpy_exp_reference(x, stepwise):
    """silu_and_mul_reference's torch code with numpy's exp in place of torch's (see module doc)."""
    def exp(t):
        return torch.from_numpy(np.exp(t.float().numpy())).to(t.dtype)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if stepwise:
        return gate / (1.0 + exp(-gate)) * up
    g = gate.float()
    return (g / (1.0 + exp(-g))).to(x.dtype) * up


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # fp16 exp(-gate) overflows, as torch's
@pytest.mark.parametrize("stepwise", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 200), (2, 5, 1500)])  # 1500: two column blocks
def test_silu_and_mul_bitwise(shape, dtype, stepwise):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3).to(dtype)
    out = silu_and_mul(x, stepwise)
    assert out.shape == (*shape[:-1], shape[-1]) and out.dtype == dtype
    assert torch.equal(out, _numpy_exp_reference(x, stepwise))
    # vs torch's own exp (an ulp apart): measured at most 2.9 eps relative (fp32), 1.25 (bf16/fp16)
    ref = silu_and_mul_reference(x, stepwise)
    d = shape[-1]
    assert ref.equal(layers.bi.silu_and_mul(x) if stepwise else F.silu(x[..., :d]) * x[..., d:])
    torch.testing.assert_close(out, ref, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)


@pytest.mark.parametrize("stepwise", [True, False])
def test_silu_and_mul_autograd(stepwise):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2 * 96, generator=g).bfloat16().requires_grad_(True)
    grad = torch.randn(4, 96, generator=g).bfloat16()
    (got,) = torch.autograd.grad(silu_and_mul(x, stepwise), x, grad)
    (ref,) = torch.autograd.grad(silu_and_mul_reference(x, stepwise), x, grad)
    assert torch.equal(got, ref)


# ---- the model code takes the kernels when use_fused_kernels says so ---------------------------

class _Config:
    hidden_size, num_attention_heads, num_key_value_heads, head_dim = 64, H, HKV, 32
    rms_norm_eps, intermediate_size, hidden_act = EPS, 96, "silu"


class _Capture:
    """Attention backend stand-in: returns q, remembers (q, k)."""

    def forward(self, q, k, v, layer_id, scaling, forward_batch):
        self.qk = (q.clone(), k.clone())
        return q


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_and_mlp_take_the_kernels(monkeypatch, qk_norm):
    from types import SimpleNamespace

    from engine.kernels import qk_norm_rope as qk_mod
    from engine.kernels import silu_and_mul as silu_mod
    from engine.kernels import small_m_linear
    from engine.models.decoder import MLP, Attention, LayerOptions

    # qkv on torch's matmul both times (TANDEM_PDL=wide would take it to the gemv, another rounding):
    # what differs between the passes is the q/k norm + rope alone
    monkeypatch.setattr(small_m_linear, "WIDE_PDL", False)
    calls = []
    for mod, name in ((qk_mod, "qk_norm_rope"), (silu_mod, "silu_and_mul")):
        real = getattr(mod, name)
        spy = lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(mod, name, spy)
    torch.manual_seed(0)
    attn = Attention(_Config, 0, LayerOptions(qk_norm=qk_norm)).bfloat16()
    mlp = MLP(_Config, LayerOptions(deterministic=True)).bfloat16()
    if qk_norm:
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = torch.rand(32).bfloat16() + 0.5
    x = torch.randn(6, 64).bfloat16()
    cos_sin = _rope(6, 32)
    fb = SimpleNamespace(attn_backend=_Capture())
    with torch.inference_mode():
        attn(x, cos_sin, fb)
        torch_qk, torch_mlp = fb.attn_backend.qk, mlp(x)
        monkeypatch.setattr(layers, "use_fused_kernels", lambda t: True)
        attn(x, cos_sin, fb)
        fused_qk, fused_mlp = fb.attn_backend.qk, mlp(x)
    assert calls == ["qk_norm_rope", "silu_and_mul"]
    eps = torch.finfo(torch.bfloat16).eps
    # bitwise elsewhere; here only numpy's exp and sum order (module docstring) can move an ulp
    torch.testing.assert_close(fused_mlp, torch_mlp, rtol=2 * eps, atol=eps * torch_mlp.abs().max().item())
    for a, b in zip(fused_qk, torch_qk):
        if qk_norm:
            torch.testing.assert_close(a, b, rtol=2 * eps, atol=eps * b.abs().max().item())
        else:
            assert torch.equal(a, b)


def test_silu_module_normal_mode_uses_f_silu_rounding(monkeypatch):
    x = (torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    monkeypatch.setattr(layers, "use_fused_kernels", lambda t: True)
    assert torch.equal(SiluAndMul(deterministic=False)(x), _numpy_exp_reference(x, stepwise=False))
    assert torch.equal(SiluAndMul(deterministic=True)(x), _numpy_exp_reference(x, stepwise=True))
