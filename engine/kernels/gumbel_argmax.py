"""gumbel_argmax_triton: argmax(logprobs + Gumbel(seed, position, vocab id)) per row on CUDA.

The arithmetic of engine.sampling.seeds.gumbel_argmax (the torch reference, which CPU runs):
the counter hash on int64 with the same 16-bit split multiplies, 52 random bits to a float64
uniform, -log(-log(u)) with libdevice's log (CUDA's log, which torch's kernels call), the fp64 sum
and the first index of the maximum, so the tokens are the reference's (tests/gpu check that).
It replaces a torch.compile'd reference: the same fusion without seconds of compile per process.
Two passes: programs over (row, vocab chunk) find each chunk's first maximum, then torch picks
the first chunk holding the row's maximum (keeps batch 1 spread over the SMs).

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.batch_invariant.triton_matmul import interpreting

CHUNK = 8192  # vocab entries per program
_BLOCK = 1024


@triton.jit
def _mul32(x, lo: tl.constexpr, hi: tl.constexpr):
    # (x * c) mod 2^32 for x < 2^32, c = hi << 16 | lo: int64 never overflows (as seeds._mul32)
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB)  # 0x7FEB352D
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C)  # 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_chunk_max_kernel(logp_ptr, stride, seeds_ptr, positions_ptr, vals_ptr, idx_ptr, V,
                             n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                             INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    h = _lowbias32((seed >> 32) & 0xFFFFFFFF)  # seeds._row_keys, same chain
    h = _lowbias32(h ^ (seed & 0xFFFFFFFF))
    h = _lowbias32(h ^ ((pos >> 32) & 0xFFFFFFFF))
    h = _lowbias32(h ^ (pos & 0xFFFFFFFF))
    key_a = _lowbias32(h ^ 0x9E3779B9)
    key_b = _lowbias32(h ^ 0x85EBCA6B)
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    best_idx = tl.zeros((BLOCK,), tl.int64)
    start = chunk.to(tl.int64) * CHUNK
    for off in tl.static_range(0, CHUNK, BLOCK):
        ids = start + off + tl.arange(0, BLOCK).to(tl.int64)
        mask = ids < V
        logp = tl.load(logp_ptr + row * stride + ids, mask=mask, other=float("-inf"))
        bits = (_lowbias32(key_a ^ ids) << 20) | (_lowbias32(key_b ^ ids) >> 12)
        u = (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2^-52: exact
        if INTERPRET:
            noise = -tl.log(-tl.log(u))
        else:
            noise = -libdevice.log(-libdevice.log(u))
        v = logp.to(tl.float64) + noise
        better = v > best  # strict: a lane keeps its first maximum
        best = tl.where(better, v, best)
        best_idx = tl.where(better, ids, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, V), axis=0)
    tl.store(vals_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, tl.where(top == float("-inf"), start, first))


def gumbel_argmax_triton(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         chunk: int = CHUNK) -> torch.Tensor:
    """[B] int64: the tokens of seeds.gumbel_argmax(logprobs [B, V], seeds [B], positions [B])."""
    B, V = logprobs.shape
    if logprobs.stride(-1) != 1:
        logprobs = logprobs.contiguous()
    n_chunks = triton.cdiv(V, chunk)
    vals = torch.empty((B, n_chunks), dtype=torch.float64, device=logprobs.device)
    idx = torch.empty((B, n_chunks), dtype=torch.int64, device=logprobs.device)
    if B:
        _gumbel_chunk_max_kernel[(B, n_chunks)](
            logprobs, logprobs.stride(0), seeds, positions, vals, idx, V, n_chunks,
            CHUNK=chunk, BLOCK=min(_BLOCK, chunk), INTERPRET=interpreting(), num_warps=4)
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
