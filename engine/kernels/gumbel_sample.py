"""gumbel_sample: one seeded sample per row straight from the logits, with its two logprobs.

The sampler's plain path (a temperature per row, nothing else reshaping the distribution: RL's
rollouts) computes raw = logits.float(), processed = log_softmax(raw / T), the token
argmax(processed + Gumbel(seed, position, id)) and the token's logprob under log_softmax(raw): a
float32 copy of [B, V], one or two [B, V] log_softmax written and read again, and the noise pass.
Here the logits are read twice and nothing of [B, V] is written:

  stats  one program a row folds the row into (max, log sum exp) with the batch-invariant
         log_softmax's own helpers, block and warps (engine/kernels/batch_invariant/triton_norm.py),
         for raw and, when a row's T is not 1, for raw / T (IEEE division, as torch divides);
  chunks (row, chunk) programs rebuild each processed logprob, (x - max) - log_z in float32 as that
         log_softmax writes it, add gumbel_argmax's noise (its helpers) and keep the first maximum;
  merge  a row's chunk maxima in order -> the token; both logprobs rebuilt from its logit.

On float32 logits the tokens and logprobs are, bit for bit, the batch-invariant log_softmax's
followed by gumbel_argmax, and a row's result never depends on its batch: deterministic mode
hands float32 over and keeps its bits. The lanes' final sum follows the load's register layout,
which Triton picks by element width, so bf16 logits (the CUDA graphs' in normal mode) give
log_z in another order: the same function, its last float32 bits apart, as torch's log_softmax
is from both.

The sampler takes it under TANDEM_FUSED_SAMPLE=1 (engine/sampling/sampler.py). Imports triton:
import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels.batch_invariant.triton_norm import softmax_lanes_finish, softmax_lanes_step, softmax_launch
from engine.kernels.gumbel_argmax import chunk_noise, chunks_winner, store_chunk_max

CHUNK = 2048  # vocab ids per chunk program: gumbel_argmax's (float64 logs per id: register heavy)
STATS = tl.constexpr(4)  # per row: raw max, raw log_z, processed max, processed log_z (a jit global)


@triton.jit
def _processed(x, t_ptr, row, TEMPERED: tl.constexpr):
    if TEMPERED:
        x = tl.math.div_rn(x, tl.load(t_ptr + row))
    return x


@triton.jit
def _processed_logprob(x, t_ptr, stats_ptr, row, TEMPERED: tl.constexpr):
    """(x / T - max) - log_z under the processed distribution's stats, as log_softmax writes it."""
    m, log_z = tl.load(stats_ptr + row * STATS + 2), tl.load(stats_ptr + row * STATS + 3)
    return (_processed(x, t_ptr, row, TEMPERED) - m) - log_z


@triton.jit
def _stats_kernel(x_ptr, t_ptr, stats_ptr, V, stride_x, TEMPERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    mt, st = m, s
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, s = softmax_lanes_step(m, s, x)
        if TEMPERED:
            mt, st = softmax_lanes_step(mt, st, _processed(x, t_ptr, row, TEMPERED))
    m_row, log_z = softmax_lanes_finish(m, s)
    if TEMPERED:
        mt_row, log_zt = softmax_lanes_finish(mt, st)
    else:
        mt_row, log_zt = m_row, log_z
    tl.store(stats_ptr + row * STATS, m_row)
    tl.store(stats_ptr + row * STATS + 1, log_z)
    tl.store(stats_ptr + row * STATS + 2, mt_row)
    tl.store(stats_ptr + row * STATS + 3, log_zt)


# seeds and positions are rows of one [4, B] tensor: an odd B misaligns the seeds' row
@triton.jit(do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"])
def _chunk_kernel(x_ptr, t_ptr, stats_ptr, seed_ptr, pos_ptr, max_ptr, idx_ptr, V, stride_x, NUM_CHUNKS,
                  TEMPERED: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    noise = chunk_noise(seed_ptr, pos_ptr, row, offs)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    logprob = _processed_logprob(x, t_ptr, stats_ptr, row, TEMPERED)
    store_chunk_max(logprob.to(tl.float64) + noise, max_ptr, idx_ptr, row, c, offs, V, NUM_CHUNKS)


@triton.jit
def _merge_kernel(x_ptr, t_ptr, stats_ptr, max_ptr, idx_ptr, ids_ptr, original_ptr, processed_ptr, stride_x,
                  NUM_CHUNKS, TEMPERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = chunks_winner(max_ptr, idx_ptr, row, NUM_CHUNKS, BLOCK)
    x = tl.load(x_ptr + row * stride_x + best.to(tl.int64)).to(tl.float32)
    tl.store(ids_ptr + row, best.to(tl.int64))
    tl.store(original_ptr + row, (x - tl.load(stats_ptr + row * STATS)) - tl.load(stats_ptr + row * STATS + 1))
    tl.store(processed_ptr + row, _processed_logprob(x, t_ptr, stats_ptr, row, TEMPERED))


def gumbel_sample(logits: torch.Tensor, temperatures: Optional[torch.Tensor], seeds: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] (float32, bf16 or fp16; vocab axis contiguous), temperatures [B] float32 > 0
    or None (all 1), seeds / positions [B] int64 -> (token ids int64 [B], their logprobs under
    log_softmax(logits) and under log_softmax(logits / T), float32 [B] each)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("gumbel_sample needs the vocab axis contiguous")
    device = logits.device
    ids = torch.empty(B, dtype=torch.int64, device=device)
    original = torch.empty(B, dtype=torch.float32, device=device)
    processed = torch.empty_like(original)
    if B == 0:
        return ids, original, processed
    tempered = temperatures is not None
    t = temperatures.reshape(B).float().contiguous() if tempered else original  # unread when not tempered
    stats = torch.empty((B, STATS.value), dtype=torch.float32, device=device)
    block, warps = softmax_launch(V)
    _stats_kernel[(B,)](logits, t, stats, V, logits.stride(0), TEMPERED=tempered, BLOCK=block, num_warps=warps)
    chunks = triton.cdiv(V, CHUNK)
    part_max = torch.empty((B, chunks), dtype=torch.float64, device=device)
    part_idx = torch.empty((B, chunks), dtype=torch.int32, device=device)
    # no fused multiply-adds: each noise value's float64 rounding is the eager reference's
    _chunk_kernel[(B, chunks)](logits, t, stats, seeds, positions, part_max, part_idx, V, logits.stride(0), chunks,
                               TEMPERED=tempered, CHUNK=CHUNK, num_warps=8, enable_fp_fusion=False)
    _merge_kernel[(B,)](logits, t, stats, part_max, part_idx, ids, original, processed, logits.stride(0), chunks,
                        TEMPERED=tempered, BLOCK=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return ids, original, processed
