"""gemv_add_norm: a split-K small-M linear, its residual add and the RMSNorm after it in one launch.

o_proj and down_proj at a small decode batch are narrow (hidden-wide) outputs: the small-M gemv
splits K to keep every SM reading, and a second launch sums the splits, adds the residual and
normalises (`small_m_linear_add_norm`). Here the gemv's programs count their arrivals
(engine/kernels/arrival_counters.py) and the last one to store its partials does that second
launch's work, row by row, with the same code (`add_norm_row`): one launch a layer fewer, twice.
The residual sum has the two launches' bits; the norm's sum over the row runs in this program's
4 warps, so where the standalone norm takes more (rows wider than 1024) the normed output can
differ in its last bit.

TANDEM_GEMV_LAST_NORM=0 keeps the second launch (A/B). Normal mode only, like the gemv.
Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import arrival_counters, env_choice
from engine.kernels.batch_invariant.triton_norm import _norm_launch
from engine.kernels.pdl import launch_options, use_pdl
from engine.kernels.small_m_linear import GemvConfig, _bias_arg, _num_sms, _tile_dot, add_norm_row, choose_config

ENABLED = env_choice("TANDEM_GEMV_LAST_NORM", "1", ("1", "0"), "1 (on, the default) or 0 (off)") == "1"


@triton.jit
def _gemv_add_norm_kernel(x_ptr, w_ptr, b_ptr, part_ptr, cnt_ptr, r_ptr, nw_ptr, normed_ptr, sum_ptr,
                          M, N, K, stride_xm, stride_wn, stride_r, stride_o, stride_s, eps,
                          K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, 16)
    m_mask = offs_m < M
    acc = _tile_dot(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, pid_k * K_PER_SPLIT, K, stride_xm, stride_wn,
                    K_PER_SPLIT, False, BLOCK_N, BLOCK_K, PDL)
    tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])
    tl.debug_barrier()  # every thread's partials are issued before one thread releases them with the count
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(1) - 1:
        for row in range(0, M):  # .cg: the other programs' partials, through L2
            add_norm_row(part_ptr, b_ptr, r_ptr, nw_ptr, normed_ptr, sum_ptr, row, M, N, stride_r, stride_o,
                         stride_s, eps, SPLIT_K, HAS_BIAS, NORM_BLOCK, ".cg")
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, config: Optional[GemvConfig] = None
                  ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """small_m_linear_add_norm's (normed, summed) in one launch; None where the gemv would not split K
    (nothing to sum: the caller's path writes y and norms it)."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = config or choose_config(N, K, _num_sms(x.device))
    if cfg.split_k == 1 or M == 0:
        return None
    normed, summed = (torch.empty((M, N), dtype=x.dtype, device=x.device) for _ in range(2))
    part = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
    pdl = use_pdl(M, x.device)
    _gemv_add_norm_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](
        x, weight, _bias_arg(bias, weight), part, arrival_counters.counters(x.device), residual, norm_weight, normed,
        summed, M, N, K, x.stride(0), weight.stride(0), residual.stride(0), normed.stride(0), summed.stride(0),
        float(eps), K_PER_SPLIT=triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k,
        SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_BLOCK=_norm_launch(N)[0], PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl))
    return normed, summed
