"""small_m_linear: y = x @ W^T (+ bias) for the few rows of a small decode batch (M <= MAX_M).

At batch 1 a decode step is a string of small weight reads: on the H200, cuBLAS spends 12.8 us
on a Qwen3-0.6B o_proj (4 MB: 1 us of bandwidth), with a tile that leaves most SMs idle
(scripts/decode_kernels_bench.py). This kernel streams W once, in [BLOCK_N, BLOCK_K] tiles spread over enough programs to
keep every SM reading: N is cut into BLOCK_N rows per program and, when that leaves too few
programs, K into SPLIT_K ranges whose float32 partials a second launch adds in a fixed order (no
atomics: the same inputs give the same bits run to run). x's rows are padded to 16 (32 past 16) inside the
tile for tl.dot; they cost registers, not bandwidth.

Fusions (each launch saved is a few microseconds at batch 1): `small_m_linear_add_norm` ends the
split-K sum with the residual add and the RMSNorm that follows o_proj and down_proj (two of a
layer's ~13 launches; the sum's bits are those of the linear then `x + residual`, the norm runs
in the standalone norm's launch shape). `gated=True` (opt-in,
slower so far) takes x as gate | up and multiplies W by silu(gate) * up computed as the tiles load,
with F.silu's rounding points but fast exp and division. The H200 measured it slower (the silu of
the whole 16-row MMA tile in every program); at M = 1 it now runs on the CUDA cores instead
(`ROW`: the activation of the one real row, 182 registers vs the tile's 249 in the sm_90 build),
not yet measured.

Normal mode: its sums differ from cuBLAS's in the last bits, and a row's result depends on M (as
cuBLAS's does on its tile choice). Deterministic mode keeps its batch-invariant matmul, unless
TANDEM_DET_GEMV runs this kernel with the matmul's own K splits (engine/kernels/bi_gemv.py).
Imports triton: import this module only where the kernels can run (CUDA or TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import env_choice
from engine.kernels.batch_invariant.triton_norm import _MAX_BLOCK, _norm_launch, rms_norm
from engine.kernels.pdl import MAX_ROWS as PDL_ROWS
from engine.kernels.pdl import WIDE as WIDE_PDL
from engine.kernels.pdl import L2_LINE, hopper_or_later, await_inputs, launch_options, prefetch_l2, prefetch_lines, use_pdl
from engine.kernels.qk_norm_rope import round_to

MAX_M = 32  # the most rows the kernel takes: x padded to a 16- or 32-row MMA tile


def rows_switch(name: str, default: str = "8") -> int:
    """A mode's most rows for this kernel, from switch `name`: 8, 16 or 32."""
    others = ", ".join(v for v in ("8", "16", "32") if v != default)
    return int(env_choice(name, default, ("8", "16", "32"), f"{default} (the default), {others}"))


# the most rows a normal-mode linear sends here (more: cuBLAS's). TANDEM_GEMV_MAX_M: at 9..32 rows no
# PDL (engine/kernels/pdl.py's MAX_ROWS) and a 32-row tile; H100, 8B bs 32: 3,463.7 tok/s at 32 vs
# 3,459.9 at 8 (level with cuBLAS), so 8 stays the default
ROWS = rows_switch("TANDEM_GEMV_MAX_M")
MAX_WEIGHT_ELEMENTS = 1 << 27  # 256 MiB of bf16: an LM head is already at bandwidth in cuBLAS
DISABLED = bool(os.environ.get("TANDEM_DISABLE_SMALL_M_LINEAR"))  # A/B benchmarks: cuBLAS at every M
# "norm" (the default): the add + norm epilogue; "1": also the activation prologue; "0": neither.
# H200, 0.6B, batch 1 (docs/benchmarks.md): the decode graph 1.123 ms with the epilogue, 1.188 ms
# without; the prologue made it slower (1.413 ms): the silu of the whole padded 16-row tile per program.
EPILOGUE_MODE = env_choice("TANDEM_SMALL_M_EPILOGUE", "norm", ("norm", "1", "0"), "norm (the default), 1 or 0")
EPILOGUE_ENABLED = EPILOGUE_MODE != "0"
GATED_PROLOGUE = EPILOGUE_ENABLED and EPILOGUE_MODE != "norm"  # opt-in: slower so far


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def choose_config(n: int, k: int, num_sms: int = 132, block_n: int = 64, block_k: int = 128,
                  programs_per_sm: int = 1, min_k_steps: int = 2) -> GemvConfig:
    """Tiles of block_n x block_k; K split until about programs_per_sm programs per SM, each split
    at least min_k_steps BLOCK_K steps and all splits equal. The defaults (64 x 128, one program per
    SM, >= 2 steps) were the H200 sweep's best, within noise, on the Qwen3-0.6B / 8B o_proj and
    down_proj (scripts/decode_kernels_bench.py sweeps the other arguments)."""
    n_programs = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(k_steps // min_k_steps, triton.cdiv(programs_per_sm * num_sms, n_programs)))
    while k_steps % split:
        split -= 1
    return GemvConfig(block_n, block_k, split)


def wide_config(n: int, num_sms: int = 132) -> GemvConfig:
    """A wide output (qkv, gate_up; TANDEM_PDL=wide) has programs enough without splitting K: one
    launch, no split-K sum after it; 32-row tiles where 64-row ones would leave SMs idle."""
    return GemvConfig(32 if triton.cdiv(n, 64) < num_sms else 64, 128, 1)


def applies(x: torch.Tensor, weight: torch.Tensor, wide: bool = False, max_rows: Optional[int] = None) -> bool:
    """Whether a linear of x by weight takes this kernel: a CUDA, half-precision call with grad
    mode off (the engine runs under inference mode; the kernel records no autograd graph), 1..max_rows
    rows (max_rows: normal mode's ROWS unless a caller says), a weight under MAX_WEIGHT_ELEMENTS and no wider out than in (o_proj, down_proj). Wider outputs (qkv, gate_up) stay with cuBLAS: at M = 1 on the H200 it was as
    fast or faster there (0.6B gate_up 6.4 vs 6.4 us, qkv 5.5 vs 6.1), and 1.5-2.4x slower on
    o_proj (12.8 vs 5.3 us) and down_proj (7.5 vs 6.1). TANDEM_PDL=wide takes them too (engine/kernels/pdl.py):
    `wide` says the caller is one of them (never an LM head); they pay only as links of a PDL
    chain, so not on a GPU before Hopper and not past PDL's MAX_ROWS (the CPU interpreter takes
    them, for the tests)."""
    max_rows = ROWS if max_rows is None else max_rows
    return (x.dim() == 2 and 0 < x.shape[0] <= min(max_rows, MAX_M) and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and (weight.shape[0] <= weight.shape[1] or (wide and _wide_pays(x)))
            and weight.numel() <= MAX_WEIGHT_ELEMENTS and weight.is_contiguous()
            and not torch.is_grad_enabled() and not DISABLED)  # no autograd graph: the engine's inference


def _wide_pays(x: torch.Tensor) -> bool:
    return WIDE_PDL and x.shape[0] <= PDL_ROWS and (x.device.type != "cuda" or hopper_or_later(x.device.index))


def applies_add_norm(x: torch.Tensor, weight: torch.Tensor, max_rows: Optional[int] = None) -> bool:
    """Whether small_m_linear_add_norm may replace the linear and the norm after it: `applies`,
    the epilogue on (TANDEM_SMALL_M_EPILOGUE) and an output row that one norm program holds."""
    return EPILOGUE_ENABLED and weight.shape[0] <= _MAX_BLOCK and applies(x, weight, max_rows=max_rows)


@triton.jit
def _x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, GATED: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile; GATED: silu(gate) * up from x's halves, rounded to x's dtype."""
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    mask = m_mask[:, None] & k_mask[None, :]
    if GATED:
        return _silu_up(ptrs, mask, K, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _silu_up(ptrs, mask, K, dt: tl.constexpr):
    """silu(gate) * up in float32 from gate at `ptrs` and up K elements on, rounded to dt where
    F.silu and the product round, with the GPU's fast exp and division: the exact ones
    (silu_and_mul's, for torch's bits) spilled registers and called the division's slow path for
    each of the MMA tile's 16 rows (15 of them padding at batch 1)."""
    gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt)  # (round_to: the interpreter's casts truncate)
    return round_to(silu * up, dt)


@triton.jit
def _w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn):
    """W's [BLOCK_N, BLOCK_K] tile (zeros past N or K)."""
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                   other=0.0)


@triton.jit
def _x_row(x_ptr, offs_k, k_mask, K, GATED: tl.constexpr):
    """x's first row [BLOCK_K] in float32, as _x_tile rounds it (GATED: silu(gate) * up)."""
    if GATED:
        return _silu_up(x_ptr + offs_k, k_mask, K, x_ptr.dtype.element_ty)
    return tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _row_dot(x_ptr, w_ptr, offs_n, n_mask, k0, K, stride_wn, K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x by W's [BLOCK_N, K_PER_SPLIT] slice on the CUDA cores -> [BLOCK_N] float32: for
    a single row the MMA tile's 15 padding rows cost registers and, gated, 16x the activation."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # products summed over K steps, reduced once
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _x_row(x_ptr, offs_k, k_mask, K, GATED)
        acc += _w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn).to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
                 GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                 ROW: tl.constexpr = False, PF_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
                 BLOCK_M: tl.constexpr = 16):
    """ROW: M == 1 on the CUDA cores (_row_dot); else x's rows padded to BLOCK_M for tl.dot. PF_LINES
    (PDL only): L2 lines of LINE elements of each weight row past the first tile asked for early."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = pid_k * K_PER_SPLIT
    if ROW:
        await_inputs(PDL)
        offs_m = tl.arange(0, 1)
        acc = _row_dot(x_ptr, w_ptr, offs_n, n_mask, k0, K, stride_wn, K_PER_SPLIT, GATED, BLOCK_N,
                       BLOCK_K)[None, :]
    else:
        offs_m = tl.arange(0, BLOCK_M)
        acc = _tile_dot(x_ptr, w_ptr, offs_m, offs_n, offs_m < M, n_mask, k0, N, K, stride_xm, stride_wn,
                        K_PER_SPLIT, GATED, BLOCK_M, BLOCK_N, BLOCK_K, PDL, PF_LINES, LINE)
    m_mask = offs_m < M
    mask = m_mask[:, None] & n_mask[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _tile_dot(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, k0, N, K, stride_xm, stride_wn,
              K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr):
    """x's rows (padded to BLOCK_M) by W's [BLOCK_N, K_PER_SPLIT] slice on the tensor cores -> [BLOCK_M, BLOCK_N]."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL:  # the first weight tile streams in while the previous kernel finishes, and L2 is asked
        # for more of the slice: no kernel writes weights during a step, so only x waits (the same
        # sums, in the same order)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)
        if PF_LINES > 0:
            last_k = tl.minimum(k0 + K_PER_SPLIT, K) - 1  # a power of two of lines may run past the slice
            pf_k = tl.minimum(k0 + BLOCK_K + tl.arange(0, PF_LINES) * LINE, last_k)
            prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn + pf_k[None, :])
        await_inputs(PDL)
        x = _x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, GATED)
        acc += tl.dot(x, tl.trans(w))
    for kk in range(BLOCK_K if PDL else 0, K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _x_tile(x_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, K, GATED)
        acc += tl.dot(x, tl.trans(_w_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn)))
    return acc


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum over splits in order (+ bias), cast to out's dtype."""
    await_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_add_norm_kernel(part_ptr, b_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, M, N, stride_r, stride_o,
                               stride_s, eps, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row: y = sum over splits in order (+ bias), rounded as the linear's output; s = y +
    residual, rounded (the next residual); out = RMSNorm(s) * w, rounded as the norm rounds."""
    await_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    z = (y + r).to(dt).to(tl.float32)
    tl.store(sum_ptr + row * stride_s + cols, z.to(dt), mask=mask)
    inv = tl.math.rsqrt(tl.sum(z * z, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, ((z * inv).to(dt).to(tl.float32) * w).to(dt), mask=mask)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   config: Optional[GemvConfig] = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, last dim contiguous), weight [N, K] contiguous, bias [N] or None ->
    [M, N] in x's dtype, accumulated in float32. gated: x is [M, 2K] (gate | up) and the rows
    multiplied are silu(gate) * up."""
    out, part, cfg = _gemv(x, weight, bias, config, gated)
    if part is not None:
        block = 1024
        M, N = out.shape
        pdl = use_pdl(M, x.device)
        _split_sum_kernel[(triton.cdiv(M * N, block),)](
            part, _bias_arg(bias, weight), out, M, N, out.stride(0), SPLIT_K=cfg.split_k,
            HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


def small_m_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            gated: bool = False, config: Optional[GemvConfig] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(y + residual) * norm_weight, y + residual) for y = small_m_linear(x, ...): what
    RMSNorm(y, residual) returns, with the sum and norm in the split-K reduction's launch.
    residual [M, N] (last dim contiguous), norm_weight [N]."""
    out, part, cfg = _gemv(x, weight, bias, config, gated)
    M, N = out.shape
    if residual.shape != out.shape or residual.stride(-1) != 1 or norm_weight.shape != (N,):
        raise ValueError(f"small_m_linear_add_norm: residual {tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)} for an output of {tuple(out.shape)}")
    if part is None:  # one split: the gemv wrote y itself; the norm is its own launch
        return rms_norm(out, norm_weight, eps, residual)
    if N > _MAX_BLOCK:
        raise ValueError(f"small_m_linear_add_norm: rows of {N} are wider than one norm program's {_MAX_BLOCK}")
    normed, summed = torch.empty_like(out), torch.empty_like(out)
    block, warps = _norm_launch(N)  # the standalone norm's tile and warps
    pdl = use_pdl(M, x.device)
    _split_sum_add_norm_kernel[(M,)](
        part, _bias_arg(bias, weight), residual, norm_weight, normed, summed, M, N, residual.stride(0),
        normed.stride(0), summed.stride(0), float(eps), SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
        BLOCK=block, PDL=pdl, num_warps=warps, **launch_options(pdl))
    return normed, summed


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          config: Optional[GemvConfig], gated: bool):
    """The first launch: -> (out [M, N], float32 partials [split_k, M, N] or None when the gemv
    wrote out itself, the config)."""
    M = x.shape[0]
    N, K = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * K if gated else K) or M > MAX_M or x.stride(-1) != 1:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} by weight {tuple(weight.shape)}"
                         + (" (gated: x is gate | up, twice the weight's K)" if gated else ""))
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    cfg = config or (wide_config(N, _num_sms(x.device)) if N > K else choose_config(N, K, _num_sms(x.device)))
    if M == 0:
        return out, None, cfg
    direct = cfg.split_k == 1
    part = None if direct else torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    pdl = use_pdl(M, x.device)
    row = gated and M == 1  # the CUDA-core path (opt-in) takes no prefetch
    pf_lines = prefetch_lines(triton.cdiv(N, cfg.block_n) * cfg.split_k, cfg.block_n,
                              (k_per_split - cfg.block_k) * weight.element_size()) if pdl and not row else 0
    _gemv_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](
        x, weight, _bias_arg(bias, weight), out, out if direct else part, M, N, K, x.stride(0),
        weight.stride(0), out.stride(0), K_PER_SPLIT=k_per_split, HAS_BIAS=bias is not None,
        DIRECT=direct, GATED=gated, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl, ROW=row,
        PF_LINES=pf_lines, LINE=L2_LINE // weight.element_size(), BLOCK_M=16 if M <= 16 else 32,
        num_warps=cfg.num_warps * (2 if gated else 1), num_stages=cfg.num_stages,  # gated at 4 warps spilled
        **launch_options(pdl))
    return out, part, cfg


def _bias_arg(bias: Optional[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    return bias if bias is not None else weight  # a pointer the kernel never reads when HAS_BIAS is off


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: plan as the H200 does
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
