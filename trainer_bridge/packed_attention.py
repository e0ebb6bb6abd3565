"""Attention over packed whole sequences for the trainer: no KV pool, K/V used as computed.

The decoder's attention layers call `forward_batch.attn_backend.forward(...)`; the trainer passes
a `PackedBatch` whose backend is `PackedAttention`, so the same model classes run a trainer-style
full-sequence forward. Each token's attention output is the same bits as when the engine (in
deterministic mode, same attention backend and split size) prefilled or decoded it:

  * "torch" (the engine's backend off CUDA): every sequence goes through
    engine.attention.deterministic.split_kv_attention, what TorchNativeAttentionBackend runs in
    deterministic mode. Differentiable as it is.
  * "triton" (the engine's default on CUDA): the Triton split-KV kernel that
    TritonAttentionBackend runs in deterministic mode, with its tile config and split size, as one
    extend of every sequence from position 0 over a "pool" that is the packed K/V itself (a row's
    bits depend only on its absolute position and its keys, see
    engine/kernels/split_kv_attention.py). Wrapped in an autograd.Function whose backward
    recomputes plain causal attention in float32 with torch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.attention.deterministic import split_kv_attention
from engine.attention.registry import default_backend, deterministic_backends, get_backend_spec
from engine.attention.split_kv_plan import DEFAULT_CONFIGS, SplitKvPlan
from engine.kernels.device_copy import h2d

# The engine backends whose deterministic bits the trainer reproduces: every backend with a
# deterministic mode (engine/attention/registry.py) needs a packed twin in PACKED_FORWARDS below.
KERNELS = deterministic_backends()


def default_split_size(kernel: str) -> int:
    """The engine backend's deterministic split size (its class's default_split_size)."""
    return get_backend_spec(kernel).load().default_split_size


class PackedAttention(AttentionBackend):
    """backend: the engine's attention backend to match, None = the engine's default for the
    device (triton on CUDA, torch elsewhere; core_setup picks the same way). split_size: None =
    that backend's default; otherwise it must equal the engine backend's split_size."""

    def __init__(self, backend: Optional[str] = None, split_size: Optional[int] = None) -> None:
        if backend is not None and backend not in KERNELS:
            raise ValueError(f"PackedAttention backend must be one of {KERNELS} (or None); got {backend!r}")
        self.backend = backend
        self._split_size = split_size

    def kernel(self, device: torch.device) -> str:
        return self.backend or default_backend(device.type)

    def split_size(self, device: torch.device) -> int:
        return self._split_size or default_split_size(self.kernel(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, forward_batch: "PackedBatch") -> torch.Tensor:
        kernel = self.kernel(q.device)
        return PACKED_FORWARDS[kernel](q, k, v, scaling, self.split_size(q.device), forward_batch)


def _torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, split: int,
                   forward_batch: "PackedBatch") -> torch.Tensor:
    """TorchNativeAttentionBackend's deterministic math, per sequence; differentiable as it is."""
    outs = []
    start = 0
    for n in forward_batch.seq_lens_cpu:
        end = start + n
        positions = torch.arange(n, device=q.device)
        outs.append(split_kv_attention(q[start:end], k[start:end], v[start:end], positions, scaling, split))
        start = end
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(q.dtype)


def _triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, split: int,
                    forward_batch: "PackedBatch") -> torch.Tensor:
    """TritonAttentionBackend's deterministic kernel; backward in float32 torch."""
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("PackedAttention 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
    meta = forward_batch.triton_metadata(split, q.device)
    return _TritonAttention.apply(q, k, v, scaling, meta)


@dataclass
class _TritonMetadata:
    """One extend from position 0 per sequence; row n of a sequence's key table is its packed row."""

    seq_lens: list[int]
    plan: SplitKvPlan
    req_to_token: torch.Tensor  # int64 [B, max_len]
    req_pool_indices: torch.Tensor  # int64 [B]


@dataclass
class PackedBatch:
    """What the model reads from a forward batch when sequences are whole and packed back to back."""

    seq_lens_cpu: list[int]
    attn_backend: AttentionBackend  # PackedAttention (the engine's bits) or VarlenAttention
    # MoE (engine/models/moe.py): routes to use instead of the router's top-k (R3 replay), and a
    # buffer the MoE layers write their routes into; both [T, layers, top_k] int32, packed rows
    replay_routes: Optional[torch.Tensor] = None
    route_sink: Optional[torch.Tensor] = None
    lora: Optional[Any] = None  # an engine.lora.LoRABatch (the trainer's adapter), read by the linears
    _metadata: dict = field(default_factory=dict, repr=False)  # built on the first layer's call

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def cumulative_lens(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(int32 [B + 1] start of each sequence and the total, longest length): flash varlen's."""
        key = ("cu_lens", device)
        if key not in self._metadata:
            lens = torch.tensor([0] + list(self.seq_lens_cpu), dtype=torch.int32)
            self._metadata[key] = (h2d(lens.cumsum(0, dtype=torch.int32), device), max(self.seq_lens_cpu, default=0))
        return self._metadata[key]

    def triton_metadata(self, split_size: int, device: torch.device) -> _TritonMetadata:
        key = (split_size, device)
        if key not in self._metadata:
            lens = list(self.seq_lens_cpu)
            # the plan TritonAttentionBackend(deterministic=True).init_forward_metadata makes for
            # an extend batch with no cached prefix
            plan = SplitKvPlan(DEFAULT_CONFIGS["deterministic_extend"], split_size,
                               prefix_lens=[0] * len(lens), extend_lens=lens,
                               keys_config=DEFAULT_CONFIGS["deterministic"])
            starts = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0)
            cols = torch.arange(max(lens, default=1), dtype=torch.int64)
            # entries past a sequence's end are never read; clamped to stay in range anyway
            table = (starts[:, None] + cols[None, :]).clamp_max(max(sum(lens) - 1, 0))
            self._metadata[key] = _TritonMetadata(lens, plan, h2d(table, device),
                                                  torch.arange(len(lens), dtype=torch.int64, device=device))
        return self._metadata[key]


class _TritonAttention(torch.autograd.Function):
    """Forward: the engine's deterministic Triton kernel. Backward: torch causal attention."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                meta: _TritonMetadata) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scaling, ctx.seq_lens = scaling, meta.seq_lens
        # as TritonAttentionBackend.forward, with the packed K/V as the pool; laid out like the
        # pool (v is often a strided view of the qkv output), so the kernel is compiled as there
        return meta.plan.attend(q, k.contiguous(), v.contiguous(), meta.req_to_token,
                                meta.req_pool_indices, scaling)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from trainer_bridge.attention_grads import causal_attention_grads  # (it imports this module)

        grads = causal_attention_grads(*ctx.saved_tensors, ctx.seq_lens, ctx.scaling, grad, ctx.needs_input_grad[:3])
        return (*grads, None, None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                     scaling: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain causal GQA attention of each packed sequence computed in `dtype`, cast to q's dtype
    (the Triton path's float32 backward; VarlenAttention's fallback; not bitwise anything).
    q [T, H, D]; k, v [T, Hkv, D]. Runs of sequences are right-padded into one batched SDPA each
    (a python loop per sequence cost the recipe's train step seconds of host time); the causal
    mask keeps every real row off the padding, so padding neither changes a row nor gets a
    gradient. Float32 takes SDPA's math backend, which is deterministic run to run."""
    lens = list(seq_lens)
    outs, start = [], 0
    for first, last in _runs(lens, q.shape[1]):
        end = start + sum(lens[first:last])
        padded = [_pad(t[start:end], lens[first:last], dtype) for t in (q, k, v)]
        with _backend_for(dtype):
            out = F.scaled_dot_product_attention(*padded, is_causal=True, scale=scaling, enable_gqa=True)
        # the real rows by index (a boolean mask's nonzero would make the host wait for the device)
        rows = h2d(_real_rows(lens[first:last], out.shape[2]), q.device)
        outs.append(out.transpose(1, 2).flatten(0, 1).index_select(0, rows))
        start = end
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(q.dtype)


MAX_SCORES = 1 << 27  # score entries (batch x heads x len^2) of one batched SDPA: 512 MiB in float32


def _runs(lens: list[int], heads: int) -> list[tuple[int, int]]:
    """[first, last) runs of consecutive sequences whose padded scores stay under MAX_SCORES (a
    sequence longer than that gets a run of its own)."""
    runs, first, longest = [], 0, 0
    for i, n in enumerate(lens):
        longest_with = max(longest, n)
        if i > first and (i - first + 1) * heads * longest_with**2 > MAX_SCORES:
            runs.append((first, i))
            first, longest_with = i, n
        longest = longest_with
    if lens:
        runs.append((first, len(lens)))
    return runs


def packed_positions(seq_lens: Sequence[int]) -> torch.Tensor:
    """int64 [sum(seq_lens)] on the host: each packed token's place in its own sequence."""
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    return torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens).repeat_interleave(lens)


def _real_rows(lens: list[int], width: int) -> torch.Tensor:
    """int64 flat indices of each sequence's rows in a [len(lens) * width] right-padded layout."""
    row_starts = torch.arange(len(lens), dtype=torch.int64) * width
    return packed_positions(lens) + row_starts.repeat_interleave(torch.tensor(lens, dtype=torch.int64))


def _pad(rows: torch.Tensor, lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Packed [T, heads, D] -> [B, heads, max(lens), D] in dtype, zeros past each sequence."""
    padded = torch.nn.utils.rnn.pad_sequence(rows.to(dtype).split(lens), batch_first=True)
    return padded.transpose(1, 2)


def _backend_for(dtype: torch.dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype == torch.float32:  # reproducible gradients for deterministic mode's trainer
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


# engine backend -> the trainer's packed forward with the same bits (see KERNELS)
PACKED_FORWARDS = {"torch": _torch_forward, "triton": _triton_forward}
