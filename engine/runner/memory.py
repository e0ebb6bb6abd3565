"""plan_memory: sizes the KV pool and the derived scheduler limits, SGLang style.

--mem-fraction-static is (weights + KV pool) / device memory. On the CPU there is no device
budget to share, so the pool defaults to a fixed size unless --max-total-tokens says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.config import ServerArgs

CPU_DEFAULT_TOTAL_TOKENS = 65536
CPU_DEFAULT_CHUNK = 2048
MAX_RUNNING_REQUESTS_CAP = 4096


@dataclass(frozen=True)
class MemoryPlan:
    max_total_num_tokens: int
    max_running_requests: int
    chunked_prefill_size: Optional[int]  # None: no chunking
    available_gb: float
    bytes_per_token: int


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_memory(
    args: ServerArgs, model: torch.nn.Module, device: torch.device,
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, context_len: int,
    extra_bytes_per_token: int = 0, extra_static_bytes: int = 0,
) -> MemoryPlan:
    """extra_bytes_per_token: what else the pool keeps per slot (routed experts); extra_static_bytes:
    fixed buffers counted with the weights (the LoRA pool)."""
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) + extra_bytes_per_token
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters()) + extra_static_bytes
        fraction = args.mem_fraction_static or _default_fraction(total)
        budget_tokens = int((total * fraction - weights) // per_token)
        available_gb = free / 2**30
        default_chunk = _gpu_default_chunk(total)
    else:
        budget_tokens = CPU_DEFAULT_TOTAL_TOKENS
        available_gb = 0.0
        default_chunk = CPU_DEFAULT_CHUNK
    total_tokens = args.max_total_tokens or budget_tokens
    if total_tokens <= 0:
        raise ValueError("no room for the KV cache: raise --mem-fraction-static or set --max-total-tokens")
    max_running = args.max_running_requests or min(max(total_tokens // 2, 1), MAX_RUNNING_REQUESTS_CAP)
    chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else default_chunk
    return MemoryPlan(total_tokens, max_running, None if chunk == -1 else chunk, available_gb, per_token)


def _default_fraction(total_bytes: int) -> float:
    # Keep ~10 GB for activations and graphs on large cards, a smaller share on small ones.
    gb = total_bytes / 2**30
    return max(0.5, min(0.88, 1 - 10 / gb)) if gb > 60 else 0.8


def _gpu_default_chunk(total_bytes: int) -> int:
    gb = total_bytes / 2**30
    return 2048 if gb < 20 else 4096 if gb < 60 else 8192 if gb < 160 else 16384
