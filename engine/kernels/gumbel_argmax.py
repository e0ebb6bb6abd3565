"""gumbel_argmax: one seeded sample per row, argmax(logprobs + Gumbel(seed, position, id)), in Triton.

The same function as engine.sampling.seeds.gumbel_argmax, element for element: the noise of
(seed, position, vocab id) is the same int64 lowbias32 chain and float64 -log(-log(u)), added to
the row's float32 logprobs in float64, so the tokens are the eager reference's. The engine ran
that reference under torch.compile, whose first calls compiled for ~6 s per shape class at
start-up and imported torch._dynamo; this kernel is compiled and cached as the engine's other
Triton kernels are (the default; TANDEM_TRITON_GUMBEL=0 takes torch.compile's: measured on an
H100 by scripts/device_suite.sh gumbelgpu readyall t1ab, docs/benchmarks.md). Stage 1 reduces CHUNK-wide slices of a
row to (max, first index of it); stage 2 takes the slices in order (engine/kernels/first_max.py:
torch.argmax's rules, the first index on ties, a NaN wins), so a row's token never depends on
its batch.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.first_max import NO_INDEX, first_max

CHUNK = 2048  # vocab ids per stage-1 program (int64 hash + float64 log per id: register heavy)


@triton.jit
def _mul32(x, c: tl.constexpr):
    # (x * c) mod 2^32 for 0 <= x < 2^32, c split in 16-bit halves so int64 never overflows
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def row_keys(seed_ptr, pos_ptr, row):
    """seeds.py's _row_keys for one row: seed hi, lo, position hi, lo chained, then two keys."""
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    h = _lowbias32((seed >> 32) & 0xFFFFFFFF)
    h = _lowbias32(h ^ (seed & 0xFFFFFFFF))
    h = _lowbias32(h ^ ((pos >> 32) & 0xFFFFFFFF))
    h = _lowbias32(h ^ (pos & 0xFFFFFFFF))
    return _lowbias32(h ^ 0x9E3779B9), _lowbias32(h ^ 0x85EBCA6B)


@triton.jit
def gumbel_noise(key_a, key_b, offs):
    """float64 Gumbel noise of the vocab ids offs under a row's keys: seeds.py's gumbel_noise
    element for element (compile without fp fusion: its rounding is the reference's)."""
    vocab = offs.to(tl.int64)
    bits = (_lowbias32(key_a ^ vocab) << 20) | (_lowbias32(key_b ^ vocab) >> 12)  # 52 random bits
    u = (bits.to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2**-52: (0, 1), exact
    return -tl.log(-tl.log(u))


@triton.jit
def chunk_noise(seed_ptr, pos_ptr, row, offs):
    key_a, key_b = row_keys(seed_ptr, pos_ptr, row)
    return gumbel_noise(key_a, key_b, offs)


@triton.jit
def store_chunk_max(noisy, max_ptr, idx_ptr, row, c, offs, V, NUM_CHUNKS):
    """Stage 1's result for chunk c of a row: the first maximum of its logprobs + noise."""
    m, idx = first_max(tl.where(offs < V, noisy, float("-inf")), offs)
    out = row * NUM_CHUNKS + c
    tl.store(max_ptr + out, m)
    tl.store(idx_ptr + out, idx)


@triton.jit
def chunks_winner(max_ptr, idx_ptr, row, NUM_CHUNKS, BLOCK: tl.constexpr):
    """Stage 2: the row's token, its chunks' maxima taken in order."""
    offs = tl.arange(0, BLOCK)
    valid = offs < NUM_CHUNKS
    m = tl.load(max_ptr + row * NUM_CHUNKS + offs, mask=valid, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_CHUNKS + offs, mask=valid, other=NO_INDEX)
    return first_max(m, idx)[1]


@triton.jit
def _chunk_kernel(x_ptr, seed_ptr, pos_ptr, max_ptr, idx_ptr, V, stride_x, NUM_CHUNKS,
                  CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    noise = chunk_noise(seed_ptr, pos_ptr, row, offs)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float64)
    store_chunk_max(x + noise, max_ptr, idx_ptr, row, c, offs, V, NUM_CHUNKS)


@triton.jit
def _merge_kernel(max_ptr, idx_ptr, ids_ptr, NUM_CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(ids_ptr + row, chunks_winner(max_ptr, idx_ptr, row, NUM_CHUNKS, BLOCK).to(tl.int64))


def gumbel_argmax(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """logprobs [B, V] (float32; vocab axis contiguous), seeds / positions [B] int64 -> [B] int64:
    argmax over v of logprobs[b, v] + Gumbel noise of (seeds[b], positions[b], v)."""
    B, V = logprobs.shape
    if logprobs.stride(-1) != 1:
        raise ValueError("gumbel_argmax needs the vocab axis contiguous")
    ids = torch.empty(B, dtype=torch.int64, device=logprobs.device)
    if B == 0:
        return ids
    chunks = triton.cdiv(V, CHUNK)
    part_max = torch.empty((B, chunks), dtype=torch.float64, device=logprobs.device)
    part_idx = torch.empty((B, chunks), dtype=torch.int32, device=logprobs.device)
    # no fused multiply-adds: each value's float64 rounding is the eager reference's
    _chunk_kernel[(B, chunks)](logprobs, seeds, positions, part_max, part_idx, V, logprobs.stride(0), chunks,
                               CHUNK=CHUNK, num_warps=8, enable_fp_fusion=False)
    _merge_kernel[(B,)](part_max, part_idx, ids, chunks, BLOCK=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return ids
