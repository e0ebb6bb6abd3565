"""Reference attention in plain torch: the oracle for the fast backends and the CPU path.

Slow on purpose (a Python loop over sequences, float32 math) and simple enough to trust.
deterministic=True swaps the per-sequence math for `split_kv_attention` (fixed splits of
`split_size` keys at absolute positions), whose rows are bitwise independent of the batch, of
chunking and of prefill vs decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.attention.deterministic import split_kv_attention, split_kv_attention_rows

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch

# Key split of deterministic mode; the trainer's PackedAttention defaults to it off CUDA.
DEFAULT_SPLIT_SIZE = 64


class TorchNativeAttentionBackend(AttentionBackend):
    default_split_size = DEFAULT_SPLIT_SIZE  # read by the trainer's PackedAttention

    def __init__(self, deterministic: bool = False, split_size: int = DEFAULT_SPLIT_SIZE) -> None:
        if split_size < 1:
            raise ValueError(f"split_size must be positive, got {split_size}")
        self.deterministic = deterministic
        self.split_size = split_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        pool = forward_batch.kv_pool
        # KV first, so each sequence reads its new tokens back from the pool like its prefix
        pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_cache = pool.get_key_buffer(layer_id)
        v_cache = pool.get_value_buffer(layer_id)
        rows = forward_batch.req_to_token[forward_batch.req_pool_indices]
        if self.deterministic and forward_batch.forward_mode.is_decode:
            return self._decode_rows(q, k_cache, v_cache, rows, scaling, forward_batch)
        out = torch.empty_like(q)
        start = 0
        for i in range(forward_batch.batch_size):
            seq_len = forward_batch.seq_lens_cpu[i]
            prefix_len = forward_batch.extend_prefix_lens_cpu[i]
            num_new = forward_batch.extend_seq_lens_cpu[i]
            if num_new == 0:
                continue
            slots = rows[i, :seq_len]
            q_new, k_seq, v_seq = q[start : start + num_new], k_cache[slots], v_cache[slots]
            if self.deterministic:
                positions = torch.arange(prefix_len, seq_len, device=q.device)
                att = split_kv_attention(q_new, k_seq, v_seq, positions, scaling, self.split_size)
            else:
                att = _attend(q_new, k_seq, v_seq, prefix_len, scaling)
            out[start : start + num_new] = att.to(q.dtype)
            start += num_new
        return out

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     scaling: float, forward_batch: "ForwardBatch") -> torch.Tensor:
        """Deterministic decode in one call for the whole batch (a Python loop per sequence would
        dominate the step); each row's bits are what its own sequence alone would give."""
        seq_lens = forward_batch.seq_lens
        max_len = max(forward_batch.seq_lens_cpu)
        slots = rows[:, :max_len]
        # past a row's end the table holds padding or stale slots: zero them so they stay finite
        past_end = (torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None])[..., None, None]
        k = k_cache[slots].masked_fill(past_end, 0.0)
        v = v_cache[slots].masked_fill(past_end, 0.0)
        return split_kv_attention_rows(q, k, v, seq_lens - 1, scaling, self.split_size).to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
            scaling: float) -> torch.Tensor:
    """q [n, H, D] at positions prefix_len.., k/v [S, Hkv, D] -> [n, H, D] float32, causal."""
    n, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # GQA without copying K/V: query heads h*group .. h*group+group-1 share kv head h
    qf = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, g, n, D]
    kf = k.float().permute(1, 0, 2)  # [Hkv, S, D]
    vf = v.float().permute(1, 0, 2)
    scores = torch.matmul(qf, kf[:, None].transpose(-1, -2)) * scaling  # [Hkv, g, n, S]
    q_pos = torch.arange(prefix_len, prefix_len + n, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf[:, None])  # [Hkv, g, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
