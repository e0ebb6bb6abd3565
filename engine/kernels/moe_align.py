"""moe_align: the (token, k) routing entries grouped by expert, each group padded to BLOCK_M rows.

topk_ids [T, K] -> entry i = t*K + k routes row t of the hidden states to expert topk_ids[t, k].
The grouped GEMMs want each expert's entries in one run of whole BLOCK_M-row blocks:
  sorted_ids [max_rows]   entry ids, expert by expert; within an expert in ascending i (so the order
                          is a function of topk_ids alone); each group padded with the sentinel T*K
  expert_ids [max_blocks] the expert of each BLOCK_M block
  total      [1]          rows in use (a multiple of BLOCK_M); blocks at or past it are not read
Sizes are upper bounds known on the host (no sync, CUDA-graph capturable): at most min(E, T*K)
experts are routed to, each wasting under BLOCK_M rows of padding.

Two launches, E programs each: count the entries of expert e; then place them (their start is the
padded counts of experts < e, summed in-program), fill the padding and name the blocks. Integer
work only, so the result is exact and deterministic. Each program scans all T*K ids (L2-resident:
512 KB at T=16384, K=8), which costs less than a sort and needs no global synchronisation.

Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_SCAN = 1024  # ids scanned per step


class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [max_rows]
    expert_ids: torch.Tensor  # int32 [max_blocks]
    total: torch.Tensor  # int32 [1]


def max_padded_rows(num_entries: int, num_experts: int, block_m: int) -> int:
    """Upper bound of `total` (a multiple of block_m)."""
    bound = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit(do_not_specialize=["n"])
def _count_kernel(ids_ptr, counts_ptr, n, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    count = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, SCAN):
        offs = start + tl.arange(0, SCAN)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(counts_ptr + expert, count)


@triton.jit(do_not_specialize=["n"])
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, total_ptr, n, E,
                  E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    mine = tl.sum(tl.where(experts == expert, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    if expert == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    placed = tl.zeros((), dtype=tl.int32)
    for scan_start in range(0, n, SCAN):
        offs = scan_start + tl.arange(0, SCAN)
        hit = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == expert).to(tl.int32)
        rank = placed + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + start + rank, offs, mask=hit != 0)
        placed += tl.sum(hit, axis=0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + count + pad, tl.full((BLOCK_M,), n, tl.int32), mask=count + pad < mine)
    for block in range(start // BLOCK_M, (start + mine) // BLOCK_M):
        tl.store(expert_ids_ptr + block, expert)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, K] int (values in [0, num_experts)) -> MoeAlignment (module docstring)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    n = ids.numel()
    rows = max_padded_rows(n, num_experts, block_m)
    dev = ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    out = MoeAlignment(torch.empty(rows, dtype=torch.int32, device=dev),
                       torch.empty(rows // block_m, dtype=torch.int32, device=dev),
                       torch.empty(1, dtype=torch.int32, device=dev))
    _count_kernel[(num_experts,)](ids, counts, n, SCAN=_SCAN, num_warps=4)
    _place_kernel[(num_experts,)](ids, counts, out.sorted_ids, out.expert_ids, out.total, n, num_experts,
                                  E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m, SCAN=_SCAN,
                                  num_warps=4)
    return out
