"""The batch-invariant matmul's persistent schedule: a fixed grid of programs walks the output tiles.

The arithmetic is triton_matmul's "seq" schedule, element for element: each tile runs the same
`_accumulate` (a fresh fp32 accumulation per K split, summed in split order) and the same store.
Only who computes a tile changes: programs stay resident and take tiles p, p + P, p + 2P, ...
(P = programs per SM x SMs), so no tile waits for a program launch; with two programs per SM, or
with Triton flattening the tile and k loops into one pipelined loop (`flatten`), a tile's loads
start while the previous tile's epilogue runs. `warp_spec` splits the warps into TMA producers
and MMA consumers. All of it is scheduling; scripts/bi_matmul_bench.py checks every candidate's
bits against the table tile's before a tier may use it.

TMA loads only (the schedule exists for sm_90); the pointer-load path keeps one program a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.batch_invariant.triton_matmul import _accumulate, _store_out, _tile_coords
from engine.kernels.pdl import await_inputs, launch_options, use_pdl


@triton.jit(do_not_specialize=["M"])  # M=1 or M%16 must not give another kernel
def _bi_mm_persistent_kernel(a_desc, b_desc, bias_ptr, out_ptr, M, N, K, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             KT_SPLIT: tl.constexpr, ONE_SPLIT: tl.constexpr, FLAT: tl.constexpr,
                             GROUP_M: tl.constexpr, STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             UPCAST: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
                             WARP_SPEC: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    n_kt = tl.cdiv(K, BLOCK_K)
    n_tm = tl.cdiv(M, BLOCK_M)
    n_tn = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tm * n_tn, STRIDE, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, n_tm, n_tn, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        total = _accumulate(a_desc, b_desc, off_m, off_n, 0, n_kt, M, N, K, 0, 0, BLOCK_M, BLOCK_N, BLOCK_K,
                            KT_SPLIT, ONE_SPLIT, FLAT, True, True, UPCAST, PRECISION)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        _store_out(total, bias_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


def launch(a_desc, b_desc, bias: torch.Tensor | None, out: torch.Tensor, M: int, N: int, K: int, cfg,
           kt_split: int, one_split: bool, num_sms: int, upcast: bool) -> None:
    """out = a @ b.T (+ bias) on min(tiles, cfg.persistent x SMs) programs (TMA descriptors in)."""
    stride = cfg.persistent * num_sms  # a constexpr of the SM count, not of M: one kernel for every M
    n_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    pdl = use_pdl(M, out.device)
    _bi_mm_persistent_kernel[(min(n_tiles, stride),)](
        a_desc, b_desc, bias if bias is not None else out, out, M, N, K, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, KT_SPLIT=kt_split,
        ONE_SPLIT=one_split, FLAT=cfg.flat, GROUP_M=cfg.group_m, STRIDE=stride,
        HAS_BIAS=bias is not None, UPCAST=upcast, PRECISION=cfg.dot_precision, FLATTEN=cfg.flatten,
        WARP_SPEC=cfg.warp_spec, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl))
