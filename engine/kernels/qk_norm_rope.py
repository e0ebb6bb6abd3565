"""qk_norm_rope: per-head RMSNorm (Qwen3 q_norm/k_norm, optional) and neox rotary for q and k in
one launch, in place on the strided q/k views of the qkv GEMM output; optionally (kv_cache) the
same launch writes the new k and v into their KV-pool slots, so the attention backend skips store_kv.

Replaces, per layer on CUDA: two row copies (q/k views are not reshapeable), two norm launches and
~14 torch rotary launches (cos/sin casts, neg, cat, two muls, add, for q and for k).

Same bits as the unfused CUDA path (bi.rms_norm per head, then rotary.apply_rotary): each value is
rounded to the model dtype where a torch op rounds (norm cast, weight multiply, cos/sin cast, each
rotary product, their sum), fp contraction is off, and the sum of squares is triton_norm's
expression at triton_norm's block and warp count over one (token, head) row at a time, as
triton_norm's program has one row, so it compiles to the same reduction tree (compared in the sm_90
PTX for D in {64, 128, 256} x fp32/bf16/fp16; tests/gpu check the bits). A program takes one head,
or from MIN_TOKENS_FOR_ROWS tokens ROWS heads of one kind, each reduced as a row of its own
(tests/kernels/test_qk_rows_compile_sm90.py compares the sequences; Triton with tuples in jit
code, 3.3 or later). Against torch's own mean (CPU or CUDA,
another summation order) the fp32 sum can differ by an ulp or two; everything after it matches.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import env_choice
from engine.kernels.batch_invariant.triton_norm import _norm_launch
from engine.kernels.pdl import await_inputs, launch_options, use_pdl
from engine.kernels.torch_backward import needs_grad, reference_grads

ROWS_ENV = "TANDEM_QK_ROWS"
ROWS_CHOICES = ("1", "2", "4", "8")
# A launch of one-head programs takes ~(T x heads) / (132 SMs x 32 resident) waves of a short
# load-reduce-store chain: at 256 tokens of the 0.6B shape 8192 programs. Fewer programs of 4
# heads each, all loads in flight together, pay off there; below ~a wave they add latency.
# H100, 0.6B (2026-12-07): bs 1 streamed ITL 1.043 ms with 1 head vs 1.088 with 4; bs 16 8,397
# vs 8,261 tok/s; bs 64 level; bs 256 25,145 vs 25,009.
MIN_TOKENS_FOR_ROWS = 128
# TANDEM_QK_ROWS: heads a program (a token's q, k or v heads in groups of this many) from
# MIN_TOKENS_FOR_ROWS tokens; each head's arithmetic is the same at any value
ROWS = int(env_choice(ROWS_ENV, "4", ROWS_CHOICES, "4 (the default), 1, 2 or 8 heads a program"))


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest even) and widened back: a torch op's output rounding."""
    if DTYPE == tl.bfloat16:
        # by hand: the interpreter's fp32 -> bf16 cast truncates; this is the GPU's rounding on both
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, H, HKV, D,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                         stride_kot, stride_koh, stride_ct, eps,
                         v_ptr, kc_ptr, vc_ptr, loc_ptr, stride_vt, stride_vh, stride_kct, stride_kch,
                         stride_vct, stride_vch, HAS_NORM: tl.constexpr, IN_PLACE: tl.constexpr,
                         STORE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)  # ROWS heads of one kind: q heads' groups, then k heads', then (STORE) v heads'
    q_groups = tl.cdiv(H, ROWS)
    k_groups = tl.cdiv(HKV, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    if g < q_groups:
        _norm_rope_rows(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, qw_ptr, g * ROWS, H,
                        cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, D, eps, cols, mask, kc_ptr, 0,
                        HAS_NORM, IN_PLACE, False, ROWS)
    elif g < q_groups + k_groups:
        kc_row = kc_ptr
        if STORE:  # the k heads' pool slot too, cast to the pool's dtype
            kc_row = kc_ptr + tl.load(loc_ptr + t).to(tl.int64) * stride_kct
        _norm_rope_rows(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, kw_ptr,
                        (g - q_groups) * ROWS, HKV, cos_ptr + t * stride_ct,
                        sin_ptr + t * stride_ct, D, eps, cols, mask, kc_row,
                        stride_kch, HAS_NORM, IN_PLACE, STORE, ROWS)
    else:  # STORE only: v heads go to their pool slot unchanged
        vc_row = vc_ptr + tl.load(loc_ptr + t).to(tl.int64) * stride_vct
        h0 = (g - q_groups - k_groups) * ROWS
        for i in tl.static_range(ROWS):
            row_mask = cols < tl.where(h0 + i < HKV, D, 0)
            v = tl.load(v_ptr + t * stride_vt + (h0 + i) * stride_vh + cols, mask=row_mask)
            tl.store(vc_row + (h0 + i) * stride_vch + cols, v.to(vc_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _norm_rope_rows(x_tok, o_tok, stride_xh, stride_oh, w_ptr, h0, n_heads, cos_row, sin_row, D, eps, cols, mask,
                    kc_row, stride_kch, HAS_NORM: tl.constexpr, IN_PLACE: tl.constexpr, STORE: tl.constexpr,
                    ROWS: tl.constexpr):
    """Heads h0..h0+ROWS-1 (those < n_heads) of one token normed and rotated, each row's
    arithmetic that of a one-row program: every row read before any is written (in place), so a
    program's loads are in flight together."""
    dt = o_tok.dtype.element_ty
    half = D // 2
    first = cols < half
    # rotate_half's partner lane is loaded (L1 hit) rather than shuffled across threads
    partner = tl.where(first, cols + half, cols - half)
    c = round_to(tl.load(cos_row + cols, mask=mask, other=0.0), dt)
    s = round_to(tl.load(sin_row + cols, mask=mask, other=0.0), dt)
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    ys = ()
    for i in tl.static_range(ROWS):
        row_mask = cols < tl.where(h0 + i < n_heads, D, 0)  # past the last head: none
        x_row = x_tok + (h0 + i) * stride_xh
        x = tl.load(x_row + cols, mask=row_mask, other=0.0).to(tl.float32)
        p = tl.load(x_row + partner, mask=row_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            # triton_norm's reduction, verbatim (x * x == its fma(x, x, 0) for a one-chunk row)
            inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            x = round_to(round_to(x * inv, dt) * w, dt)  # normalise, cast, then weight: HF order
            p = round_to(round_to(p * inv, dt) * wp, dt)  # the partner lane's own value, same ops
        rotated = tl.where(first, -p, p)
        ys = ys + (round_to(round_to(x * c, dt) + round_to(rotated * s, dt), dt),)
    if IN_PLACE:
        tl.debug_barrier()  # every partner read of these rows lands before any lane overwrites one
    for i in tl.static_range(ROWS):
        row_mask = cols < tl.where(h0 + i < n_heads, D, 0)  # past the last head: none
        tl.store(o_tok + (h0 + i) * stride_oh + cols, ys[i].to(dt), mask=row_mask)
        if STORE:
            tl.store(kc_row + (h0 + i) * stride_kch + cols, ys[i].to(kc_row.dtype.element_ty), mask=row_mask)


def _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out, kv_cache=None) -> None:
    T, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype or D % 2:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs the head_dim axis contiguous")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both norm weights or neither")
    for w in (q_weight, k_weight):
        if w is not None and (w.dtype != q.dtype or w.shape != (D,)):
            raise TypeError(f"qk_norm_rope: norm weight {tuple(w.shape)} {w.dtype} for {q.dtype} heads")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"qk_norm_rope: cos/sin must be [{T}, {D}], got {tuple(cos.shape)}")
    v, k_cache, v_cache, loc = kv_cache if kv_cache is not None else (k, k, k, k)
    if kv_cache is not None:
        _check_kv_cache(k, v, k_cache, v_cache, loc)
    if T == 0:
        return
    has_norm = q_weight is not None
    qw = q_weight.contiguous() if has_norm else q
    kw = k_weight.contiguous() if has_norm else k
    block, warps = _norm_launch(D)  # triton_norm's: same tile, same reduction tree
    pdl = use_pdl(T, q.device)
    rows = ROWS if T >= MIN_TOKENS_FOR_ROWS else 1
    groups = triton.cdiv(H, rows) + triton.cdiv(Hkv, rows) * (2 if kv_cache is not None else 1)
    _qk_norm_rope_kernel[(T, groups)](
        q, k, q_out, k_out, cos, sin, qw, kw, H, Hkv, D, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), float(eps), v, k_cache, v_cache, loc, v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HAS_NORM=has_norm,
        IN_PLACE=q_out.data_ptr() == q.data_ptr(), STORE=kv_cache is not None,
        BLOCK=block, ROWS=rows, PDL=pdl, num_warps=warps, enable_fp_fusion=False, **launch_options(pdl))



def _check_kv_cache(k, v, k_cache, v_cache, loc) -> None:
    """kv_cache = (v [T, Hkv, D], k and v pool buffers [slots, Hkv, D], loc [T] slot ids)."""
    if v.shape != k.shape or k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != k.shape[1:] \
            or loc.shape != (k.shape[0],):
        raise ValueError(f"qk_norm_rope: kv_cache of v {tuple(v.shape)}, pools {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, loc {tuple(loc.shape)} for k {tuple(k.shape)}")
    if v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope: the kv_cache tensors need the head_dim axis contiguous")


def qk_norm_rope_reference(q, k, cos, sin, q_weight=None, k_weight=None, eps=1e-6):
    """The unfused torch path (RMSNorm then rotary.apply_rotary); its autograd is the backward."""
    from engine.kernels.batch_invariant.ops import rms_norm_reference
    from engine.kernels.rotary import apply_rotary

    def one(x, w):
        return apply_rotary(x if w is None else rms_norm_reference(x, w, eps), cos, sin)

    return one(q, q_weight), one(k, k_weight)


class _QKNormRope(torch.autograd.Function):
    """Out of place (q/k are views of the qkv output autograd tracks); backward recomputes the
    torch reference on the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, q_weight, k_weight, eps):
        ctx.save_for_backward(q, k, cos, sin, q_weight, k_weight)
        ctx.eps = eps
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        grads = reference_grads(lambda *t: qk_norm_rope_reference(*t, eps=ctx.eps), ctx.saved_tensors,
                                ctx.needs_input_grad[:6], (grad_q, grad_k))
        return (*grads, None)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None,
                 eps: float = 1e-6, kv_cache: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] (head_dim contiguous, any row/head strides); cos/sin [T, D]
    float32; norm weights [D] in q's dtype, or None for no norm. Returns (q, k) normed and rotated:
    written in place into q and k when no gradient is recorded, else fresh tensors (autograd).
    kv_cache: (v, k pool buffer, v pool buffer, slot ids [T]): the same launch also writes the new
    k and v into their KV-pool slots, cast to the pool's dtype (what store_kv would do next)."""
    if needs_grad(q, k, cos, sin, q_weight, k_weight):
        if kv_cache is not None:
            raise ValueError("qk_norm_rope: kv_cache is for inference (a KV pool is not differentiable)")
        return _QKNormRope.apply(q, k, cos, sin, q_weight, k_weight, eps)
    _launch(q, k, cos, sin, q_weight, k_weight, eps, q, k, kv_cache)
    return q, k
