"""greedy_logprob: each row's argmax and its log_softmax value in one read of the logits.

Plain greedy decoding (no penalties, masks or temperature) needs, per row, the first index of the
largest logit and that token's logprob under the original distribution, -log(sum(exp(x - max))).
The torch path materialises a float32 log_softmax of [B, V] (write + read) and runs argmax on
its own: ~260 us per step at B = 256, V = 152k on the H200 (`tandem bench --profile`), ~45 us at
B = 1. Here stage 1 reduces CHUNK-wide slices of each row to (max, first argmax, sum of
exp(x - max)) and stage 2 merges a row's slices in order: the logits are read once, and the same
inputs give the same bits run to run. The sum's order differs from torch's, so a logprob can
differ from torch.log_softmax in the last float32 bits: normal mode only (deterministic mode
keeps its batch-invariant log_softmax, whose bits the trainer reproduces).

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.first_max import NO_INDEX, first_max

CHUNK = 4096  # logits per stage-1 program: 16 KiB of float32


@triton.jit
def _chunk_kernel(x_ptr, max_ptr, idx_ptr, sum_ptr, V, stride_x, NUM_CHUNKS, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m, idx = first_max(x, offs)  # NaN when the chunk has one: its sum is NaN too
    s = tl.sum(tl.where(offs < V, tl.exp(x - m), 0.0), axis=0)
    out = row * NUM_CHUNKS + c
    tl.store(max_ptr + out, m)
    tl.store(idx_ptr + out, idx)
    tl.store(sum_ptr + out, s)


@triton.jit
def _merge_kernel(max_ptr, idx_ptr, sum_ptr, ids_ptr, logprob_ptr, NUM_CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    valid = offs < NUM_CHUNKS
    m = tl.load(max_ptr + row * NUM_CHUNKS + offs, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_CHUNKS + offs, mask=valid, other=NO_INDEX)
    s = tl.load(sum_ptr + row * NUM_CHUNKS + offs, mask=valid, other=0.0)
    top, best = first_max(m, idx)
    total = tl.sum(tl.where(valid & (m > float("-inf")), s * tl.exp(m - top), 0.0), axis=0)
    tl.store(ids_ptr + row, best.to(tl.int64))
    # no finite logit in the row (all NaN or -inf): NaN, as torch's log_softmax gives
    tl.store(logprob_ptr + row, tl.where((top != top) | (top == float("-inf")), float("nan"), -tl.log(total)))


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (float32, bf16 or fp16; last dim contiguous) -> (ids int64 [B], logprobs
    float32 [B]): argmax per row (first on ties) and log_softmax(logits.float())[row, id]."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("greedy_logprob needs the vocab axis contiguous")
    ids = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return ids, logprobs
    chunks = triton.cdiv(V, CHUNK)
    part_max = torch.empty((B, chunks), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty((B, chunks), dtype=torch.int32, device=logits.device)
    _chunk_kernel[(B, chunks)](logits, part_max, part_idx, part_sum, V, logits.stride(0), chunks,
                               CHUNK=CHUNK, num_warps=8)
    _merge_kernel[(B,)](part_max, part_idx, part_sum, ids, logprobs, chunks,
                        BLOCK=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return ids, logprobs
