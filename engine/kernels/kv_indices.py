"""build_kv_indices: a batch's KV slots back to back, the page table of a paged-attention kernel
whose pages hold one token (flashinfer's kv_indices at page_size=1).

out[kv_indptr[i] : kv_indptr[i] + seq_lens[i]] = req_to_token[req_pool_indices[i], :seq_lens[i]]
as int32. One launch, one program per sequence; every length and offset is read on the device,
so it needs no host sync and can be captured in a CUDA graph over static buffers.

Imports triton: import this module only where a Triton-capable device is in use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor) -> None:
    """req_to_token [rows, max_context] int64; req_pool_indices, seq_lens [B]; kv_indptr [B + 1]
    int32 (the cumsum of seq_lens); out int32 with at least kv_indptr[B] entries."""
    batch_size = seq_lens.numel()
    if batch_size == 0:
        return
    if req_to_token.stride(1) != 1:
        raise ValueError("build_kv_indices needs req_to_token rows contiguous")
    _kv_indices_kernel[(batch_size,)](req_to_token, req_pool_indices, seq_lens, kv_indptr, out,
                                      req_to_token.stride(0), BLOCK=512, num_warps=4)


@triton.jit
def _kv_indices_kernel(ReqToToken, Rows, SeqLens, Indptr, Out, stride_row, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(Rows + i).to(tl.int64)
    n = tl.load(SeqLens + i).to(tl.int32)
    start = tl.load(Indptr + i).to(tl.int64)
    for off in range(0, n, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n
        slots = tl.load(ReqToToken + row * stride_row + cols, mask=mask)
        tl.store(Out + start + cols, slots.to(tl.int32), mask=mask)
