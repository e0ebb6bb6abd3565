"""The trainer's causal attention over packed sequences, against a float64 per-sequence reference:
`causal_attention` (right-padded batched SDPA, split into runs) and VarlenAttention (flash varlen
on CUDA; on the CPU it falls back to causal_attention). Forward values and gradients."""

from __future__ import annotations

import pytest
import torch

from trainer_bridge import packed_attention
from trainer_bridge.packed_attention import PackedBatch, causal_attention
from trainer_bridge.varlen_attention import VarlenAttention

LENS = [5, 1, 9, 3, 12, 2]
HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Explicit masked softmax per sequence in float64; GQA: query head h reads kv head h // group."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.double().split(lens), k.double().split(lens), v.double().split(lens)):
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * SCALE
        n = qs.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(outs)


def _inputs(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENS)
    return [torch.randn(total, heads, DIM, generator=gen).requires_grad_(True)
            for heads in (HEADS, KV_HEADS, KV_HEADS)]


def _value_and_grads(fn, inputs: list[torch.Tensor], weight: torch.Tensor):
    out = fn(*inputs)
    grads = torch.autograd.grad((out.double() * weight).sum(), inputs)
    return out.detach().double(), [g.double() for g in grads]


@pytest.mark.parametrize("max_scores", [packed_attention.MAX_SCORES, 300])  # one run; a run per ~1-3 sequences
def test_causal_attention_matches_the_reference(monkeypatch, max_scores):
    monkeypatch.setattr(packed_attention, "MAX_SCORES", max_scores)
    inputs = _inputs()
    weight = torch.randn(sum(LENS), HEADS, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, want_grads = _value_and_grads(lambda q, k, v: reference(q, k, v, LENS), inputs, weight)
    got, got_grads = _value_and_grads(lambda q, k, v: causal_attention(q, k, v, LENS, SCALE), inputs, weight)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert (g - w).abs().max() < 1e-5


def test_runs_split_where_the_padded_scores_would_pass_the_budget(monkeypatch):
    monkeypatch.setattr(packed_attention, "MAX_SCORES", 2 * 4 * 9**2)  # two 9-long sequences of 4 heads
    assert packed_attention._runs([9, 9, 9, 3], 4) == [(0, 2), (2, 4)]
    assert packed_attention._runs([30], 4) == [(0, 1)]  # over budget alone: a run of its own
    assert packed_attention._runs([], 4) == []


def test_varlen_attention_matches_the_reference_on_this_device():
    inputs = _inputs(2)
    weight = torch.randn(sum(LENS), HEADS, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    batch = PackedBatch(list(LENS), VarlenAttention())
    want, want_grads = _value_and_grads(lambda q, k, v: reference(q, k, v, LENS), inputs, weight)
    got, got_grads = _value_and_grads(lambda q, k, v: batch.attn_backend.forward(q, k, v, 0, SCALE, batch),
                                      inputs, weight)
    assert (got - want).abs().max() < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert (g - w).abs().max() < 1e-5


def test_cumulative_lens_are_flash_varlens_offsets():
    batch = PackedBatch([3, 1, 4], VarlenAttention())
    cu, longest = batch.cumulative_lens(torch.device("cpu"))
    assert cu.tolist() == [0, 3, 4, 8] and cu.dtype == torch.int32 and longest == 4


@pytest.mark.parametrize("max_scores", [packed_attention.MAX_SCORES, 300, 4 * 12 * 5])
def test_the_deterministic_backward_in_bounded_runs_and_blocks(monkeypatch, max_scores):
    """causal_attention_grads (the Triton path's backward): whole runs, runs of one sequence, and
    sequences split into query blocks (4 heads x 12 rows x 5 keys: the 12-long one in 3 blocks)."""
    from trainer_bridge.attention_grads import causal_attention_grads

    monkeypatch.setattr(packed_attention, "MAX_SCORES", max_scores)
    inputs = _inputs(4)
    grad_out = torch.randn(sum(LENS), HEADS, DIM, generator=torch.Generator().manual_seed(5))
    want_grads = torch.autograd.grad((reference(*inputs, LENS) * grad_out.double()).sum(), inputs)
    got = causal_attention_grads(*(t.detach() for t in inputs), LENS, SCALE, grad_out, (True, True, True))
    for g, w in zip(got, want_grads):
        assert g.shape == w.shape and (g.double() - w).abs().max() < 1e-5
    only_q = causal_attention_grads(*(t.detach() for t in inputs), LENS, SCALE, grad_out, (True, False, False))
    assert only_q[1] is None and only_q[2] is None and torch.equal(only_q[0], got[0])
