"""store_kv: one launch writes the new tokens' K and V into their pool slots.

Bytes, per layer: read T * Hkv * D elements of k and of v (plus T slot ids), write as many into
the pool. A decode step at bs=256 on the Qwen3-8B shape (8 kv heads, D=128, bf16) moves
2 * 256 * 8 * 128 * 2 B = 1 MiB in and 1 MiB out: ~0.6 us at 3.8 TB/s. So the cost is launches,
not bytes. `buf[loc] = x.to(dtype)` is two index_put launches (K, V) plus a cast copy whenever the
dtypes differ; this kernel is one launch for both, with the cast fused, and it is capturable in a
CUDA graph like any other launch.

Imports triton: import this module only where the triton backend is in use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> k_buf[loc], v_buf[loc] ([size+1, Hkv, D], cast to the pool dtype)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("store_kv needs the head_dim axis contiguous")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        HKV=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim),
        num_warps=4,
    )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all its kv heads, K and V
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(KBuf + slot * stride_kbt + h * stride_kbh + d, k.to(KBuf.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(VBuf + slot * stride_vbt + h * stride_vbh + d, v.to(VBuf.dtype.element_ty), mask=mask)
