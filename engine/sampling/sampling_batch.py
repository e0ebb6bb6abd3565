"""SamplingBatch: per-row sampling state as device tensors, so the Sampler never sees requests.

Greedy rows are stored as temperature 1, whole-vocab top-k, top_p 1 and min_p 0, which makes
every processing step a no-op for them. The `need_*` flags are host booleans computed here, so
the sampler can skip whole steps without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional, Sequence

import numpy as np
import torch

from engine.kernels.device_copy import h2d
from engine.sampling.seeds import to_int64
from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int  # sampling_seed, a derived seed for n>1, or one drawn by the front end (RequestBuilder)
    position: int  # absolute position of the token being sampled (the noise counter)
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()  # tokens generated so far
    # ids the row may not emit while len(output_ids) < min_new_tokens (EOS + stop_token_ids)
    suppress_ids: Sequence[int] = ()


@dataclass
class SamplingBatch:
    vocab_size: int
    temperatures: torch.Tensor  # [B, 1] float32
    top_ks: torch.Tensor  # [B] int64, in [1, V]
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    is_greedy: torch.Tensor  # [B] bool
    output_counts: Optional[torch.Tensor]  # [B, V] float32 count of each id in the output so far
    seen_mask: Optional[torch.Tensor]  # [B, V] bool, id occurs in prompt or output
    suppress_mask: Optional[torch.Tensor]  # [B, V] bool, ids banned by min_new_tokens
    grammar_bitmask: Optional[torch.Tensor]  # [B, ceil(V/32)] int32, xgrammar's packed mask: bit set = allowed next
    logit_bias: Optional[torch.Tensor]  # [B, V] float32 added to the logits (SGLang's logit_bias)
    all_greedy: bool
    any_greedy: bool
    need_temperature: bool  # a row's temperature is not 1 (greedy rows count as 1)
    need_repetition: bool
    need_freq_presence: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @property
    def batch_size(self) -> int:
        return self.seeds.shape[0]

    @property
    def need_truncation(self) -> bool:
        """A row cuts its distribution: top-k, top-p or min-p."""
        return self.need_top_k or self.need_top_p or self.need_min_p

    @property
    def plain_sampled(self) -> bool:
        """Every row sampled, from its logits at its temperature alone (RL's rollouts): no greedy
        row, penalty, bias, ban, grammar mask or truncation."""
        return not (self.any_greedy or self.need_repetition or self.need_freq_presence or self.need_truncation
                    or self.logit_bias is not None or self.suppress_mask is not None
                    or self.grammar_bitmask is not None)

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """The batch's sampling tensors; grammar_bitmask is None here: the runner sets it after,
        once the grammar fill (on a worker thread) is in."""
        greedy = [r.params.is_greedy for r in rows]
        temps = [1.0 if g else r.params.temperature for r, g in zip(rows, greedy)]
        top_ks = [_top_k(r.params, g, vocab_size) for r, g in zip(rows, greedy)]
        top_ps = [1.0 if g else r.params.top_p for r, g in zip(rows, greedy)]
        min_ps = [0.0 if g else r.params.min_p for r, g in zip(rows, greedy)]
        rep = [r.params.repetition_penalty for r in rows]
        freq = [r.params.frequency_penalty for r in rows]
        pres = [r.params.presence_penalty for r in rows]
        need_rep = any(p != 1.0 for p in rep)
        need_fp = any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres)

        # two host -> device copies a step, not one per field (each is a pinned staging copy and
        # a launch on a host-bound decode loop)
        floats = h2d(torch.tensor([temps, top_ps, min_ps, rep, freq, pres], dtype=torch.float32), device)
        ints = h2d(torch.tensor([top_ks, [to_int64(r.seed) for r in rows], [r.position for r in rows], greedy],
                                dtype=torch.int64), device)
        return cls(
            vocab_size=vocab_size,
            temperatures=floats[0].view(-1, 1),
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            repetition_penalties=floats[3],
            frequency_penalties=floats[4],
            presence_penalties=floats[5],
            seeds=ints[1],
            positions=ints[2],
            is_greedy=ints[3].bool(),
            output_counts=_output_counts(rows, vocab_size, device) if need_fp else None,
            seen_mask=_seen_mask(rows, vocab_size, device) if need_rep else None,
            suppress_mask=_suppress_mask(rows, vocab_size, device),
            grammar_bitmask=None,
            logit_bias=_logit_bias(rows, vocab_size, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_temperature=any(t != 1.0 for t in temps),
            need_repetition=need_rep,
            need_freq_presence=need_fp,
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_min_p=any(p > 0.0 for p in min_ps),
        )


def _top_k(params: SamplingParams, greedy: bool, vocab_size: int) -> int:
    # greedy rows are argmax'ed directly; -1 and oversized k mean the whole vocab
    if greedy or params.top_k < 0:
        return vocab_size
    return min(params.top_k, vocab_size)


def _scatter_ids(
    per_row: list[tuple[Sequence[int], ...]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten each row's id lists into (row index, id) tensors for one index_put."""
    lengths = torch.tensor([sum(map(len, parts)) for parts in per_row], dtype=torch.int64)
    flat = chain.from_iterable(chain.from_iterable(per_row))
    ids = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=int(lengths.sum())))
    rows = torch.repeat_interleave(torch.arange(len(per_row)), lengths)
    return h2d(rows, device), h2d(ids, device)


def _output_counts(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    idx = _scatter_ids([(r.output_ids,) for r in rows], device)
    ones = torch.ones(idx[0].shape[0], dtype=torch.float32, device=device)
    return counts.index_put_(idx, ones, accumulate=True)


def _seen_mask(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor:
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    idx = _scatter_ids([(r.prompt_ids, r.output_ids) for r in rows], device)
    return mask.index_put_(idx, torch.ones_like(idx[0], dtype=torch.bool))


def _suppress_mask(rows: list[SamplingRow], vocab_size: int, device) -> Optional[torch.Tensor]:
    banned = [
        (r.suppress_ids,) if len(r.output_ids) < r.params.min_new_tokens else () for r in rows
    ]
    if not any(len(ids) for parts in banned for ids in parts):
        return None
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    idx = _scatter_ids(banned, device)
    return mask.index_put_(idx, torch.ones_like(idx[0], dtype=torch.bool))


def _logit_bias(rows: list[SamplingRow], vocab_size: int, device) -> Optional[torch.Tensor]:
    """Dense [B, V] biases, or None when no row sets logit_bias (the common case: no tensor)."""
    if not any(r.params.logit_bias for r in rows):
        return None
    pairs = [r.params.logit_bias_ids() for r in rows]
    bias = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    idx = _scatter_ids([(ids,) for ids, _ in pairs], device)
    values = torch.tensor([v for _, vals in pairs for v in vals], dtype=torch.float32)
    return bias.index_put_(idx, h2d(values, device))
