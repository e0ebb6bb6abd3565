"""Batch-invariant matmul (out = x @ w.T + bias) in Triton.

Why a row's bits never depend on M: every output element is computed as
    total = 0; for s in splits(K): total = total + partial_s;  out = cast(total + bias)
where split s covers K elements [s*split_k, (s+1)*split_k) and partial_s is a fresh fp32 tensor-core
accumulation over that range in ascending k steps. Split length and dot precision come from the
config, a function of (N, K, dtype) only. M only chooses how the same arithmetic is scheduled:
  * the tile (triton_ops.M_TIERS): on sm_90 each element is the same chain of k16 MMA
    steps in any tile shape (measured bitwise, see triton_ops);
  * "seq": one program per output tile runs the splits in order, total kept in registers;
  * "par": one program per (tile, split) writes partial_s to an fp32 workspace; the partials are
    then summed in split order, by the last program to finish the tile ("fused", found with an
    atomic counter) or by a second kernel ("kernel").
fp32 addition of the same operands in the same order gives the same bits in both schedules, so
small M gets split-K parallelism and large M avoids the workspace, without a bit of difference.
Rows are independent in the MMA, so padding rows (clamped or TMA zero-filled) never touch real rows.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_inputs, launch_options, use_pdl

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None


@dataclass(frozen=True)
class MatmulConfig:
    """One kernel configuration. split_k and dot_precision fix the arithmetic; on sm_90 the tile
    (block_m/n/k, warps) was measured not to change a bit (triton_ops docstring), the rest is
    scheduling only."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    split_k: int = 1024  # K elements per split (a multiple of block_k); 0 = all of K in one split
    num_warps: int = 4
    dot_precision: str = "tf32"  # for fp32 inputs only: "ieee" matches F.linear without TF32
    num_stages: int = 4
    group_m: int = 8
    use_tma: bool = True
    flat: bool = True  # one k loop across split ends (loads stay in flight) vs a loop per split
    par_max_tiles: int = 0  # "par" while the output has fewer tiles than this (0: 0.75 x #SMs)
    reduce: str = "fused"  # how "par" sums the partials: "fused" or "kernel"

    def num_splits(self, K: int) -> int:
        return 1 if self.split_k <= 0 or self.split_k >= K else triton.cdiv(K, self.split_k)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    # Grouped order so GROUP_M row tiles reuse weight tiles from L2; launch order only.
    width = GROUP_M * n_tiles_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def _load_tiles(a_src, b_src, a_base, b_base, off_m, off_n, k, K, BLOCK_K: tl.constexpr,
                USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    if USE_TMA:
        a = a_src.load([off_m, k])  # out-of-range rows/K are zero-filled by the copy engine
        b = b_src.load([off_n, k])
    elif EVEN_K:
        a = tl.load(a_base + k)
        b = tl.load(b_base + k)
    else:
        k_ok = (k + tl.arange(0, BLOCK_K)) < K
        a = tl.load(a_base + k, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_base + k, mask=k_ok[None, :], other=0.0)
    if UPCAST:  # the CPU interpreter cannot dot bf16/fp16; their products are exact in fp32 anyway
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _accumulate(a_src, b_src, off_m, off_n, kt_lo, kt_hi, M, N, K, stride_am, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                KT_SPLIT: tl.constexpr, ONE_SPLIT: tl.constexpr, FLAT: tl.constexpr,
                USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr):
    """0 + p_s + p_s+1 + ... for the splits covering k tiles [kt_lo, kt_hi), where p_s is a fresh
    fp32 accumulation over split s (k tiles [s*KT_SPLIT, (s+1)*KT_SPLIT)) in ascending order.
    ONE_SPLIT: [kt_lo, kt_hi) lies in one split; returns p_s itself (0 + p_s but for the sign of a
    zero, which the sum over splits, starting from +0, erases)."""
    # Clamp rows/cols instead of masking: loads stay unpredicated, stores are masked later.
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_TMA:
        a_base = a_src
        b_base = b_src
    else:
        a_base = a_src + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_base = b_src + tl.where(cols < N, cols, 0).to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_SPLIT:  # no second accumulator or split test in the loop: the MMAs stay asynchronous
        for kt in tl.range(kt_lo, kt_hi):
            a, b = _load_tiles(a_src, b_src, a_base, b_base, off_m, off_n, kt * BLOCK_K, K, BLOCK_K,
                               USE_TMA, EVEN_K, UPCAST)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        total = acc
    elif FLAT:
        # One loop over all k tiles so loads stay in flight across split ends; the reset becomes
        # the MMA's use-accumulator flag, the add runs once per split.
        for kt in tl.range(kt_lo, kt_hi):
            a, b = _load_tiles(a_src, b_src, a_base, b_base, off_m, off_n, kt * BLOCK_K, K, BLOCK_K,
                               USE_TMA, EVEN_K, UPCAST)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            if ((kt + 1) % KT_SPLIT == 0) | (kt == kt_hi - 1):
                total = total + acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        for s in range(kt_lo // KT_SPLIT, tl.cdiv(kt_hi, KT_SPLIT)):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in tl.range(tl.maximum(s * KT_SPLIT, kt_lo), tl.minimum((s + 1) * KT_SPLIT, kt_hi)):
                a, b = _load_tiles(a_src, b_src, a_base, b_base, off_m, off_n, kt * BLOCK_K, K, BLOCK_K,
                                   USE_TMA, EVEN_K, UPCAST)
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
            total = total + acc
    return total


@triton.jit
def _store_out(total, bias_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:  # bias joins in fp32 before the single rounding to the output dtype
        total = total + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials(ws_ptr, rows, cols, M, N, n_splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Same additions, same order as the "seq" schedule: 0 + p0 + p1 + ...
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, n_splits):
        # .cg: read through L2, partials were written by other SMs (their L1 lines may be stale)
        part_ptrs = ws_ptr + (s * M).to(tl.int64) * N + offs
        total = total + tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit(do_not_specialize=["M"])  # M=1 or M%16 must not give another kernel
def _bi_mm_kernel(a_src, b_src, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_am, stride_bn,
                  stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  KT_SPLIT: tl.constexpr, ONE_SPLIT: tl.constexpr, FLAT: tl.constexpr,
                  GROUP_M: tl.constexpr, PARALLEL: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)  # before the activations, the workspace and the counters are touched
    n_kt = tl.cdiv(K, BLOCK_K)
    n_splits = tl.cdiv(n_kt, KT_SPLIT)
    pid = tl.program_id(0)
    if PARALLEL:  # one program per (tile, split); the splits of a tile are neighbours in launch order
        tile = pid // n_splits
        split = pid % n_splits
        kt_lo = split * KT_SPLIT
        kt_hi = tl.minimum(kt_lo + KT_SPLIT, n_kt)
    else:
        tile = pid
        kt_lo = 0
        kt_hi = n_kt
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    total = _accumulate(a_src, b_src, off_m, off_n, kt_lo, kt_hi, M, N, K, stride_am, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, KT_SPLIT, ONE_SPLIT, FLAT, USE_TMA, EVEN_K, UPCAST,
                        PRECISION)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if PARALLEL:
        # total is p_split here; the sum over splits below adds 0 + p_0 + p_1 ... in split order.
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(ws_ptr + (split * M).to(tl.int64) * N + offs, total, mask=mask)
        if FUSED_REDUCE:
            # Every thread's partial is issued before one thread releases it with the counter.
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == n_splits - 1:
                total = _sum_partials(ws_ptr, rows, cols, M, N, n_splits, BLOCK_M, BLOCK_N)
                _store_out(total, bias_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for reuse
    else:
        _store_out(total, bias_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, n_splits, stride_om, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = _sum_partials(ws_ptr, rows, cols, M, N, n_splits, BLOCK_M, BLOCK_N)
    _store_out(total, bias_ptr, out_ptr, rows, cols, M, N, stride_om, HAS_BIAS)


_COUNTERS: dict[tuple, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 16


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 tile counters, one buffer per (device, stream); the kernel re-zeroes them."""
    if n > _COUNTER_SLOTS:
        raise ValueError(f"par schedule with {n} tiles exceeds {_COUNTER_SLOTS} counters")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_ok(t: torch.Tensor) -> bool:
    return (TensorDescriptor is not None and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def choose_schedule(M: int, N: int, K: int, cfg: MatmulConfig, device: torch.device) -> str:
    """"par" while the output tiles alone would leave SMs idle; same bits either way."""
    if cfg.num_splits(K) == 1:
        return "seq"
    n_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    # measured on the H200 (bi_matmul_bench): "seq" wins from ~0.75 x #SMs output tiles up
    limit = cfg.par_max_tiles or 3 * _num_sms(device) // 4
    return "par" if n_tiles < limit else "seq"


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: MatmulConfig,
           schedule: str | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias) -> [M, N] in x.dtype; schedule None picks "par"/"seq" by M."""
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    n_splits = cfg.num_splits(K)
    if n_splits > 1 and cfg.split_k % cfg.block_k:
        raise ValueError(f"split_k {cfg.split_k} is not a multiple of block_k {cfg.block_k}")
    parallel = n_splits > 1 and (schedule or choose_schedule(M, N, K, cfg, x.device)) == "par"
    use_tma = cfg.use_tma and _tma_ok(x) and _tma_ok(w)
    a_src = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k]) if use_tma else x
    b_src = TensorDescriptor(w, [N, K], [w.stride(0), 1], [cfg.block_n, cfg.block_k]) if use_tma else w
    n_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    fused = cfg.reduce == "fused"
    ws = torch.empty((n_splits, M, N), dtype=torch.float32, device=x.device) if parallel else out
    cnt = _counters(x.device, n_tiles) if parallel and fused else out
    bias_arg = bias if bias is not None else out
    kt_split = cfg.split_k // cfg.block_k if n_splits > 1 else 1 << 20
    pdl = use_pdl(M, x.device)  # decode at small batch: how it is launched, not what it computes
    _bi_mm_kernel[(n_tiles * n_splits,) if parallel else (n_tiles,)](
        a_src, b_src, bias_arg, out, ws, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        KT_SPLIT=kt_split,
        ONE_SPLIT=n_splits == 1 or parallel,  # a "par" program covers one split
        FLAT=cfg.flat, GROUP_M=cfg.group_m, PARALLEL=parallel, FUSED_REDUCE=fused and parallel,
        HAS_BIAS=bias is not None, USE_TMA=use_tma, EVEN_K=K % cfg.block_k == 0,
        UPCAST=interpreting() and x.dtype != torch.float32, PRECISION=cfg.dot_precision, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    if parallel and not fused:
        grid = (triton.cdiv(M, 32), triton.cdiv(N, 128))
        _reduce_kernel[grid](ws, bias_arg, out, M, N, n_splits, out.stride(0), BLOCK_M=32, BLOCK_N=128,
                             HAS_BIAS=bias is not None, num_warps=4)
    return out
