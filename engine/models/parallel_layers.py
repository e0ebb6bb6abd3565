"""Tensor-parallel versions of the decoder's linears, embedding and LM head (SGLang's design).

Column-parallel (stacked QKV, gate_up): each rank holds its own q / kv heads and its slice of the
intermediate size, so attention and the activation run rank-locally. Row-parallel (o_proj,
down_proj): each rank multiplies its input slice and the partial sums are all-reduced; the bias is
added once, after the reduce. Vocab-parallel embedding: each rank looks up the ids in its vocab
slice (zeros elsewhere) and the rows are all-reduced. LM head: each rank its vocab slice, the
logits all-gathered on every rank.

Loading contract (engine/models/decoder.py): a parameter's module answers `checkpoint_shape`
(the full HF tensor's shape) and `rank_part` (this rank's piece of that tensor), for the weight
or the bias, per stacked shard. A whole stacked tensor (engine name, shard None) is split into its
shards first. With tp_size 1 none of these classes is built.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.parallel_state import TPGroup, kv_heads_per_rank
from engine.kernels import batch_invariant as bi
from engine.models.layers import Linear, MergedGateUp, QKVLinear, embedding_weight


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], deterministic: bool) -> torch.Tensor:
    return bi.linear(x, weight, bias) if deterministic else F.linear(x, weight, bias)


def _rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return tensor.narrow(0, start, size)


class TPSharded:
    """The loading contract; `attr` is "weight" or "bias"."""

    def checkpoint_shape(self, attr: str, shard_id: Any) -> tuple[int, ...]:
        raise NotImplementedError

    def rank_part(self, attr: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class StackedColumnParallel(TPSharded):
    """Shared by the stacked column-parallel linears: each shard of the full tensor is cut by rows
    (`_shard_rows`: start, size), and a whole stacked tensor is split into its full shards first."""
    full_sizes: dict[Any, int]

    def _shard_rows(self, shard_id: Any) -> tuple[int, int]:
        raise NotImplementedError

    def checkpoint_shape(self, attr: str, shard_id: Any) -> tuple[int, ...]:
        rows = sum(self.full_sizes.values()) if shard_id is None else self.full_sizes[shard_id]
        return (rows,) if attr == "bias" else (rows, self.in_features)

    def rank_part(self, attr: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        if shard_id is not None:
            return _rows(tensor, *self._shard_rows(shard_id))
        pieces = tensor.split(list(self.full_sizes.values()), dim=0)
        return torch.cat([_rows(p, *self._shard_rows(s)) for s, p in zip(self.full_sizes, pieces)])


class QKVParallelLinear(StackedColumnParallel, QKVLinear):
    """This rank's q heads and kv heads of the stacked q/k/v projection."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 deterministic: bool, tp: TPGroup) -> None:
        local_kv = kv_heads_per_rank(num_kv_heads, tp.size)
        super().__init__(hidden_size, num_heads // tp.size, local_kv, head_dim, bias, deterministic)
        self.head_dim = head_dim
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        self.q_start = tp.rank * (num_heads // tp.size) * head_dim
        # replicated kv heads (tp > num_kv_heads): rank r keeps head r * num_kv_heads // tp
        kv_head = tp.rank * local_kv if num_kv_heads >= tp.size else tp.rank * num_kv_heads // tp.size
        self.kv_start = kv_head * head_dim

    def _shard_rows(self, shard_id: Any) -> tuple[int, int]:
        start = self.q_start if shard_id == "q" else self.kv_start
        return start, self.shard_sizes[shard_id]


class MergedGateUpParallel(StackedColumnParallel, MergedGateUp):
    """This rank's slice of the intermediate size, for gate (shard 0) and up (shard 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, deterministic: bool,
                 tp: TPGroup) -> None:
        if intermediate_size % tp.size:
            raise ValueError(f"tp_size {tp.size} must divide intermediate_size {intermediate_size}")
        local = intermediate_size // tp.size
        super().__init__(hidden_size, local, bias, deterministic)
        self.full_sizes = {0: intermediate_size, 1: intermediate_size}
        self.start = tp.rank * local

    def _shard_rows(self, shard_id: Any) -> tuple[int, int]:
        return self.start, self.shard_sizes[shard_id]


class RowParallelLinear(TPSharded, Linear):
    """This rank's slice of the input features; the partial outputs are summed over ranks."""
    small_m_epilogue = False  # the residual add and norm follow the all-reduce

    def __init__(self, in_features: int, out_features: int, bias: bool, deterministic: bool, tp: TPGroup) -> None:
        if in_features % tp.size:
            raise ValueError(f"tp_size {tp.size} must divide {in_features} input features")
        super().__init__(in_features // tp.size, out_features, bias, deterministic)
        self.full_in = in_features
        self.tp = tp

    def checkpoint_shape(self, attr: str, shard_id: Any) -> tuple[int, ...]:
        return (self.out_features,) if attr == "bias" else (self.out_features, self.full_in)

    def rank_part(self, attr: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        if attr == "bias":  # whole on every rank, added once after the reduce
            return tensor
        return tensor.narrow(1, self.tp.rank * self.in_features, self.in_features)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        """lora: always None here (LoRA is refused with tp_size > 1)."""
        out = self.tp.all_reduce(_linear(x, self.weight, None, self.deterministic), fixed_order=self.deterministic)
        return out if self.bias is None else out + self.bias


class VocabSlice(TPSharded):
    """Rows [start, start + per_rank) of a vocab-sized tensor; the last rank's rows past the vocab
    are padding (zeros), so every rank has the same shape (a tied LM head shares it)."""
    vocab_size: int
    per_rank: int
    start: int

    def _set_slice(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank

    def checkpoint_shape(self, attr: str, shard_id: Any) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    def rank_part(self, attr: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        real = max(0, min(self.per_rank, self.vocab_size - self.start))
        part = tensor.narrow(0, self.start, real)
        if real == self.per_rank:
            return part
        return torch.cat([part, part.new_zeros(self.per_rank - real, *part.shape[1:])])


class VocabParallelEmbedding(VocabSlice, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        per_rank = -(-vocab_size // tp.size)
        nn.Embedding.__init__(self, per_rank, hidden_size, _weight=embedding_weight(per_rank, hidden_size))
        self._set_slice(vocab_size, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # exact in any order: one rank holds each row, the others add zeros
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabSlice, Linear):
    """Logits of this rank's vocab slice, all-gathered: every rank returns [N, vocab]."""

    def __init__(self, vocab_size: int, hidden_size: int, deterministic: bool, tp: TPGroup) -> None:
        Linear.__init__(self, hidden_size, -(-vocab_size // tp.size), False, deterministic)
        self._set_slice(vocab_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = _linear(x, self.weight, None, self.deterministic)
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab_size]

    def _cublas_output(self, x: torch.Tensor) -> bool:
        return False  # a slice's logits, all-gathered: forward_into copies the gathered whole
