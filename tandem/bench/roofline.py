"""Roofline: the fastest a workload could run on this device, from two measured rates.

Decode is bandwidth bound: every step reads all weights used in a forward (the embedding table
is a lookup and is skipped; lm_head is read) plus the live KV of the running batch at its mean
context (prompt + output / 2). Attention reads each request's own KV, shared grpo prefixes
included, unless the engine decodes with shared-prefix (cascade) attention: then a grpo prompt's
KV is read once per group of n samples a step. A step costs max(bytes / bandwidth, FLOPs /
matmul rate).
Prefill is compute bound: 2 * matmul params per computed token, plus causal attention
(QK^T and PV: 4 * layers * heads * head_dim * L^2 / 2 per prompt), at the matmul rate; a
grpo prompt is computed once per group.
MoE: a token multiplies by its top_k of num_experts experts only (active params), and a decode
step reads the experts its batch touches, E * (1 - (1 - k/E)^batch) per layer in expectation
under uniform routing (what random dummy weights give).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tandem.bench import device as dev
from tandem.bench.workload import Workload


@dataclass(frozen=True)
class DeviceRates:
    copy_bandwidth_bytes_s: float  # bytes read + written per second, device to device
    matmul_flops_s: float
    matmul_dtype: str
    matmul_size: int


@dataclass(frozen=True)
class ModelShape:
    decode_weight_bytes: int  # read by one decode step: all weights but the embedding table
    matmul_params: int  # params in matmuls per token: layers + lm_head
    lm_head_params: int
    kv_bytes_per_token: int
    num_layers: int
    num_heads: int
    head_dim: int
    expert_bytes: int = 0  # stacked expert weights (MoE), in decode_weight_bytes
    expert_params: int = 0  # in matmul_params
    num_experts: int = 0
    top_k: int = 0

    def active_matmul_params(self) -> int:
        """Matmul params one token multiplies by (its top_k experts of the MoE layers)."""
        if not self.num_experts:
            return self.matmul_params
        return self.matmul_params - self.expert_params + self.expert_params * self.top_k // self.num_experts

    def step_weight_bytes(self, batch: int) -> float:
        """Weight bytes a decode step of `batch` rows reads: expected experts touched only."""
        if not self.num_experts:
            return self.decode_weight_bytes
        touched = 1 - (1 - self.top_k / self.num_experts) ** batch
        return self.decode_weight_bytes - self.expert_bytes + self.expert_bytes * touched


def measure_device(device: torch.device) -> DeviceRates:
    """Big-tensor copy bandwidth and square-matmul rate (bf16 8192^3 on a GPU; a smaller
    float32 one on the CPU, where bf16 matmuls are emulated and slow)."""
    gpu = device.type == "cuda"
    copy_bytes = (2 if gpu else 0.25) * 2**30
    bw = _copy_bandwidth(device, int(copy_bytes))
    size, dtype = (8192, torch.bfloat16) if gpu else (1024, torch.float32)
    return DeviceRates(bw, _matmul_rate(device, size, dtype), str(dtype).replace("torch.", ""), size)


def _timed(device: torch.device, fn, iters: int) -> float:
    fn()  # warm-up: allocation, kernel selection
    dev.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dev.synchronize(device)
    return (time.perf_counter() - start) / iters


def _copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(device, lambda: dst.copy_(src), iters=20 if device.type == "cuda" else 3)
    return 2 * nbytes / seconds


def _matmul_rate(device: torch.device, size: int, dtype: torch.dtype) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = _timed(device, lambda: a @ b, iters=20 if device.type == "cuda" else 3)
    return 2 * size**3 / seconds


def model_shape(model: nn.Module, hf_config: Any, kv_bytes_per_token: int) -> ModelShape:
    unique = {id(p): p for p in model.parameters()}.values()
    total_bytes = sum(p.numel() * p.element_size() for p in unique)
    total_params = sum(p.numel() for p in unique)
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight
    tied = embed is lm_head
    # tied: the one table is read as lm_head; untied: the embedding table is never streamed
    decode_bytes = total_bytes if tied else total_bytes - embed.numel() * embed.element_size()
    matmul_params = total_params - embed.numel() + (lm_head.numel() if tied else 0)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    from engine.models.moe import ExpertWeights

    experts = [m.weight for m in model.modules() if isinstance(m, ExpertWeights)]
    return ModelShape(decode_bytes, matmul_params, lm_head.numel(), kv_bytes_per_token,
                      hf_config.num_hidden_layers, hf_config.num_attention_heads, head_dim,
                      expert_bytes=sum(w.numel() * w.element_size() for w in experts),
                      expert_params=sum(w.numel() for w in experts),
                      num_experts=int(getattr(hf_config, "num_experts", 0) or 0) if experts else 0,
                      top_k=int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if experts else 0)


def floor(workload: Workload, shape: ModelShape, rates: DeviceRates, max_batch: int,
          shared_prefix: bool = False) -> dict[str, Any]:
    """Lower bound on the workload's time, and the output tok/s it allows. shared_prefix: the
    engine reads a grpo prompt's KV once per group (cascade decode), not once per sample."""
    attn_unit = 4 * shape.num_layers * shape.num_heads * shape.head_dim  # FLOPs per (query, key) pair
    # prefill: layers for every computed token, lm_head only for each request's last token
    layer_params = shape.active_matmul_params() - shape.lm_head_params
    prefill_flops = (2 * layer_params * sum(workload.unique_input_lens)
                     + 2 * shape.lm_head_params * workload.num_requests
                     + attn_unit * sum(L * L / 2 for L in workload.unique_input_lens))
    prefill_s = prefill_flops / rates.matmul_flops_s
    batch = min(workload.num_requests, max_batch)
    mean_ctx = (workload.total_input_tokens + workload.total_output_tokens / 2) / workload.num_requests
    kv_tokens = batch * mean_ctx
    if shared_prefix and workload.n > 1:  # each sample's prompt copy beyond the first is not read
        kv_tokens -= batch * (1 - 1 / workload.n) * workload.total_input_tokens / workload.num_requests
    step_bytes = shape.step_weight_bytes(batch) + kv_tokens * shape.kv_bytes_per_token
    step_flops = 2 * shape.active_matmul_params() * batch + attn_unit * batch * mean_ctx
    step_s = max(step_bytes / rates.copy_bandwidth_bytes_s, step_flops / rates.matmul_flops_s)
    steps = math.ceil(workload.total_output_tokens / batch)  # perfect packing of decode rows
    decode_s = steps * step_s
    memory_bound = step_bytes / rates.copy_bandwidth_bytes_s >= step_flops / rates.matmul_flops_s
    return {
        **asdict(rates), **asdict(shape),
        "decode_batch": batch, "decode_steps": steps, "mean_context": mean_ctx,
        "shared_prefix_reads": bool(shared_prefix and workload.n > 1),
        "decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
        "decode_step_floor_ms": step_s * 1e3,
        "decode_bound": "memory" if memory_bound else "compute",
        "prefill_flops": prefill_flops, "prefill_floor_s": prefill_s, "decode_floor_s": decode_s,
        "floor_s": prefill_s + decode_s,
        "output_tok_s": workload.total_output_tokens / (prefill_s + decode_s),
    }


def max_decode_batch(workload: Workload, max_running_requests: int, max_total_tokens: int) -> int:
    """How many requests the engine's limits let decode together at the workload's full length."""
    per_request = max(workload.input_lens) + max(workload.output_lens)
    return max(1, min(max_running_requests, max_total_tokens // per_request))
