"""Split-KV attention whose result for a query row depends only on that row and its keys.

Used by the torch backend in deterministic mode (keys read back from the KV pool) and by the
trainer's policy (keys passed in directly), so both produce the same bits (DESIGN section 4).

Why a row at absolute position p gets the same bits in prefill, chunked prefill, decode and the
trainer's full-sequence forward, whatever else is in the batch:
  * keys are cut into splits [j*S, (j+1)*S) at absolute positions, each zero-padded to exactly S
    keys, so every reduction over keys has length S; keys after p score -inf and weigh exactly 0;
  * every reduction (q.k over head_dim, sum-exp and p.v over a split) is an elementwise product
    followed by torch.sum over a contiguous last dim: torch reduces each output serially in an
    order set by the reduced length alone, never by the number of rows (a batched matmul is not:
    MKL picks its kernel by M);
  * splits are merged one by one in ascending order; splits wholly after p (present in a prefill
    chunk or a batch with longer sequences, absent when the row runs alone) add exact zeros at
    the end, which change no bit.
Two entry points share that arithmetic: `split_kv_attention` (rows of one sequence sharing its
keys: prefill, trainer) and `split_kv_attention_rows` (one row per sequence: a decode batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# elements of the largest [rows, heads, keys, head_dim] product one block may build
_BLOCK_ELEMENTS = 1 << 22


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                       scaling: float, split_size: int = 64) -> torch.Tensor:
    """Causal GQA attention of one sequence.

    q [n, H, D] at absolute positions q_positions [n]; k, v [L, Hkv, D] hold the sequence's keys
    at positions 0..L-1 (L > every query position). Returns [n, H, D] float32. Differentiable.
    """
    k_s, v_s = _splits(k[None], v[None], split_size)
    return _blocked(q, q_positions, k_s, v_s, scaling, split_size, per_row=False)


def split_kv_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                            scaling: float, split_size: int = 64) -> torch.Tensor:
    """One query row per sequence, each with its own keys (a decode batch).

    q [b, H, D]; row i sits at q_positions[i] and attends k[i, :q_positions[i] + 1] (k, v
    [b, L, Hkv, D]; entries past a row's position are ignored but must be finite). Returns
    [b, H, D] float32, each row bitwise what `split_kv_attention` gives it.
    """
    k_s, v_s = _splits(k, v, split_size)
    return _blocked(q, q_positions, k_s, v_s, scaling, split_size, per_row=True)


def _splits(k: torch.Tensor, v: torch.Tensor, split_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [kb, L, Hkv, D] -> keys [kb, Hkv, J, S, D] and values [kb, Hkv, J, D, S], zero past L
    (finite, so a masked key's 0 * v is 0)."""
    kb, seq_len, num_kv_heads, head_dim = k.shape
    num_splits = -(-seq_len // split_size)
    pad = (0, 0, 0, 0, 0, num_splits * split_size - seq_len)
    shape = (kb, num_splits, split_size, num_kv_heads, head_dim)
    k_s = F.pad(k.float(), pad).view(shape).permute(0, 3, 1, 2, 4).contiguous()
    v_s = F.pad(v.float(), pad).view(shape).permute(0, 3, 1, 4, 2).contiguous()
    return k_s, v_s


def _blocked(q: torch.Tensor, q_pos: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, scaling: float,
             split_size: int, per_row: bool) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_splits = k_s.shape[2]
    key_pos = torch.arange(num_splits * split_size, device=q.device).view(num_splits, split_size)
    # rows are independent, so blocking them only bounds memory; it changes no bit
    rows = max(1, _BLOCK_ELEMENTS // (num_heads * num_splits * split_size * head_dim))
    blocks = []
    for start in range(0, n, rows):
        pos = q_pos[start : start + rows]
        used = int(pos.max()) // split_size + 1  # later splits would only add exact zeros
        keys = slice(start, start + rows) if per_row else slice(None)
        blocks.append(_attend_block(q[start : start + rows], pos, k_s[keys, :, :used], v_s[keys, :, :used],
                                    key_pos[:used], scaling))
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out.view(n, num_heads, head_dim)


def _attend_block(q: torch.Tensor, q_pos: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor,
                  key_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [b, H, D]; k_s [1|b, Hkv, J, S, D]; v_s [1|b, Hkv, J, D, S]; key_pos [J, S] -> [b, H, D]."""
    b, num_heads, head_dim = q.shape
    num_kv_heads, num_splits = k_s.shape[1], k_s.shape[2]
    group = num_heads // num_kv_heads
    # GQA without copying K/V: query heads h*G .. h*G+G-1 share kv head h
    qf = q.float().reshape(b, num_kv_heads, group, 1, 1, head_dim)
    scores = _sum_last(qf * k_s[:, :, None]) * scaling  # [b, Hkv, G, J, S]
    masked = key_pos[None] > q_pos[:, None, None]  # [b, J, S]
    scores = scores.masked_fill(masked[:, None, None], float("-inf"))
    m = scores.amax(-1)  # [b, Hkv, G, J]; -inf for a split wholly after the row
    m_safe = m.masked_fill(m == float("-inf"), 0.0)  # exp(-inf - 0) = 0 rather than NaN
    p = torch.exp(scores - m_safe[..., None])
    l = _sum_last(p)  # [b, Hkv, G, J]
    acc = _sum_last(p[..., None, :] * v_s[:, :, None])  # [b, Hkv, G, J, D]
    m_all = m.amax(-1)  # exact: max does not round
    w = torch.exp(m[..., 0] - m_all)
    num, den = w[..., None] * acc[..., 0, :], w * l[..., 0]
    for j in range(1, num_splits):  # fixed ascending order
        w = torch.exp(m[..., j] - m_all)
        num = num + w[..., None] * acc[..., j, :]
        den = den + w * l[..., j]
    return (num / den[..., None]).reshape(b, num_heads, head_dim)


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    # a contiguous last dim makes the sum an inner reduction, serial per output element
    return x.contiguous().sum(-1)
