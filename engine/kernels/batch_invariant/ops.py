"""Batch-invariant linear, RMSNorm, SiLU-and-mul and log_softmax: a row's bits never depend on
how many rows share the call or where the row sits (DESIGN section 4).

On CUDA, linear / rms_norm / log_softmax run the Triton kernels of `triton_ops`, imported on the
first CUDA call only (CI has no Triton); if that import fails they fall back to the torch code
here. When a gradient is needed (the trainer's Policy) the kernels run inside the
autograd.Functions of `autograd` (same forward, torch backward).
Measured on the CPU (AMD EPYC, torch 2.13, MKL 2024.2, AVX-512, 1-4 threads) —
tests/engine/test_batch_invariant_ops.py re-checks all of it wherever the suite runs:
  * F.linear (float32) is NOT batch-invariant: row 0 comes out in three versions, for M=1, for
    M=2..3 and for M>=4 (every shape tried, K and N from 64 to 4096). A fixed-shape call is: the
    same [ROW_TILE, K] product gives a row the same bits at every position in the tile, at 1, 2
    or 4 threads and any input alignment. So `linear` cuts the rows into zero-padded tiles of
    ROW_TILE rows, each its own MKL call of that one shape.
  * Which tile sizes hold depends on MKL's code path (the CPU, or MKL_ENABLE_INSTRUCTIONS): its
    AVX2 kernels (Intel without AVX-512) work in blocks of 6 rows, so a 32-row tile gives rows
    30-31 other bits, 8 and 16 rows fail for some shapes, 64 rows are split across 4 threads.
    Tiles of 12, 24 and 48 rows held on the SSE4.2, AVX2 and AVX-512 paths at 1, 2 and 4
    threads for every K in 32..1024 and N in 32..3000 tried (56 shapes; Xeon, torch 2.13, MKL
    2024.2), and 24 at 8 threads too; at 16 threads with K=1000 MKL splits K and no tile holds:
    `linear` caps torch's threads at MAX_INVARIANT_THREADS at its first CPU call.
  * The mean of RMSNorm and torch.log_softmax reduce each row serially, in an order set by the
    row length only: invariant as they are (vocab 151936 included).
  * F.silu is NOT: its vectorised body and scalar tail round differently, and which elements fall
    in the tail depends on the tensor's size and thread split (gate of width 100, 1001 rows, 2
    threads: the split falls inside row 500, which then differs from the row alone).
    x / (1 + exp(-x)) uses only exp (same bits on both paths) and correctly rounded IEEE ops.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Optional, Union

import torch
import torch.nn.functional as F

from engine.kernels.torch_backward import needs_grad

logger = logging.getLogger(__name__)

# Rows per matmul call on the CPU. Part of the numerics contract: engine and trainer must use
# the same value (a different tile is a different MKL kernel path, hence different bits).
ROW_TILE = 24
# Threads the tiles held at (the thread count does not change a row's bits up to here); at 16
# MKL may split K, and then no tile holds: more threads are capped to this at the first call
MAX_INVARIANT_THREADS = 8


@functools.lru_cache(maxsize=1)
def _cap_threads() -> None:
    threads = torch.get_num_threads()
    if threads > MAX_INVARIANT_THREADS:
        torch.set_num_threads(MAX_INVARIANT_THREADS)
        logger.info("batch-invariant CPU linear: torch threads %d -> %d (more may split K, changing bits)",
                    threads, MAX_INVARIANT_THREADS)


@functools.lru_cache(maxsize=1)
def _triton_ops() -> Optional[ModuleType]:
    try:
        from engine.kernels.batch_invariant import triton_ops
    except Exception as exc:  # no Triton, or a broken build: the torch path still holds on CPU
        logger.warning("batch-invariant Triton kernels unavailable (%s); using the torch path", exc)
        return None
    return triton_ops


def _cuda_ops(x: torch.Tensor, *inputs: Optional[torch.Tensor]) -> Optional[ModuleType]:
    """The Triton ops for a CUDA call; `autograd`'s differentiable wrappers of them when grad mode
    is on and one of the inputs requires grad."""
    ops = _triton_ops() if x.is_cuda else None
    if ops is not None and needs_grad(x, *inputs):
        from engine.kernels.batch_invariant import autograd

        return autograd
    return ops


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T + bias -> [..., N], rows independent of the batch."""
    ops = _cuda_ops(x, weight, bias)
    if ops is not None:
        return ops.bi_linear(x, weight, bias)
    _cap_threads()
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, -M % ROW_TILE))
    tiles = [F.linear(tile, weight) for tile in padded.split(ROW_TILE)]
    out = (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:M]
    if bias is not None:  # added after the product, like the Triton epilogue
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
             ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """HF RMSNorm (normalise in fp32, cast, then weight); with residual returns
    (norm(x + residual), x + residual), the sum being the next residual."""
    ops = _cuda_ops(x, weight, residual)
    if ops is not None:
        return ops.bi_rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None):
    """The torch formulation of `rms_norm` (the CPU path; the CUDA path's backward)."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    x = x + residual
    return _rms_norm(x, weight, eps), x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax over the last dim, one fixed reduction order per row."""
    ops = _cuda_ops(x)
    if ops is not None:
        return ops.bi_log_softmax(x)
    return torch.log_softmax(x.float(), dim=-1)


def greedy_log_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, V] -> (argmax ids [N], log_softmax(x) at them [N]): greedy decoding's token and
    logprob, the bits of `log_softmax` then a gather (one read of the logits on CUDA)."""
    x = x.detach()  # ids and values to report: no gradient (and _cuda_ops' autograd forms have no such op)
    ops = _cuda_ops(x)
    if ops is not None:
        return ops.bi_greedy_log_softmax(x)
    ids = torch.argmax(x, dim=-1)
    return ids, log_softmax(x).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] (gate | up) -> silu(gate) * up, elementwise with the same bits on every path."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return gate / (1.0 + torch.exp(-gate)) * up
