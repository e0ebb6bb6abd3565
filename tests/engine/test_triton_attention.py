"""Triton attention under the Triton interpreter on the CPU, at small sizes.

Checks the backend against the torch oracle (mixed batches with cached prefixes, chunked extends,
decode), and the deterministic-mode properties bitwise: a sequence's rows are the same alone or
among others, however its prefill was chunked, and whether a position was prefilled or decoded.
Skipped where triton is absent (CI) and on CUDA machines (tests/gpu cover those).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton")

from engine.attention.torch_native import TorchNativeAttentionBackend  # noqa: E402
from engine.attention.triton import TritonAttentionBackend  # noqa: E402
from engine.testing.attention_scene import AttentionScene as Scene  # noqa: E402

SPLIT = 16
LENS = [37, 65, 34, 80, 50]  # total lengths of the five test sequences


@pytest.fixture(scope="module")
def scene():
    return Scene(LENS)


def det(num_sms=8):
    return TritonAttentionBackend(deterministic=True, split_size=SPLIT, num_sms=num_sms)


MIXED = [(0, 0, 37), (1, 20, 45), (2, 33, 1), (3, 64, 16), (4, 7, 30)]
DECODE = [(s, n - 1, 1) for s, n in enumerate(LENS)]


def assert_close_to_torch(scene, backend, items, decode=False):
    got = scene.run(backend, items, decode)
    ref = scene.run(TorchNativeAttentionBackend(), items, decode)
    for g, r in zip(got, ref):
        assert (g - r).abs().max().item() <= 1e-4


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "normal"])
def test_extend_matches_torch(scene, deterministic):
    backend = TritonAttentionBackend(deterministic=deterministic, split_size=SPLIT)
    assert_close_to_torch(scene, backend, MIXED)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "normal"])
@pytest.mark.parametrize("num_sms", [1, 64], ids=["merge", "partials"])
def test_decode_matches_torch(scene, deterministic, num_sms):
    backend = TritonAttentionBackend(deterministic=deterministic, split_size=SPLIT, num_sms=num_sms)
    assert_close_to_torch(scene, backend, DECODE, decode=True)


def test_gqa_group_of_three_and_head_dim_32():
    scene = Scene([40, 23], heads=6, kv_heads=2, head_dim=32, seed=1)
    assert_close_to_torch(scene, det(), [(0, 9, 31), (1, 0, 23)])
    assert_close_to_torch(scene, det(num_sms=64), [(0, 39, 1), (1, 22, 1)], decode=True)


def test_batch_invariance_bitwise(scene):
    backend = det()
    together = scene.run(backend, MIXED)
    for item, rows in zip(MIXED, together):
        assert torch.equal(scene.run(backend, [item])[0], rows)
    together = scene.run(backend, DECODE, decode=True)  # bs 5 and bs 1 use different lanes
    for item, rows in zip(DECODE, together):
        assert torch.equal(scene.run(backend, [item], decode=True)[0], rows)


def test_chunked_prefill_bitwise(scene):
    backend = det()
    whole = scene.run(backend, [(3, 0, 80)])[0]
    cuts = [0, 7, 23, 50, 80]  # not aligned to the split or the q block
    chunks = [scene.run(backend, [(3, a, b - a)])[0] for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(chunks), whole)


@pytest.mark.parametrize("num_sms", [1, 64], ids=["merge", "partials"])
def test_prefill_equals_decode_bitwise(scene, num_sms):
    prefill = scene.run(det(), [(3, 0, 80)])[0]
    backend = det(num_sms)
    for pos in (0, 5, 15, 16, 17, 31, 32, 47, 63, 64, 79):
        decoded = scene.run(backend, [(3, pos, 1), (0, 36, 1)], decode=True)[0]
        assert torch.equal(decoded[0], prefill[pos]), pos


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "normal"])
def test_graph_metadata_with_padding(scene, deterministic):
    """The capture/replay plan over static buffers, with padded rows, gives the eager rows."""
    backend = TritonAttentionBackend(deterministic=deterministic, split_size=SPLIT, num_sms=8)
    backend.init_cuda_graph_state(8, max(LENS) + 1, 4, 2, 16, torch.device("cpu"))
    padded_bs, items = 8, DECODE[:3]
    fb = scene.batch(backend, items, decode=True)
    pad = padded_bs - len(items)
    req = torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
    seq_lens = torch.cat([fb.seq_lens, torch.ones(pad, dtype=torch.int64)])
    backend.init_forward_metadata_capture(padded_bs, req, seq_lens)
    backend.init_forward_metadata_replay(padded_bs, req, seq_lens)
    fb.req_pool_indices, fb.seq_lens = req, seq_lens
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
    q_pad = [(0, 0, 1)] * pad  # padding rows: any q, written to slot 0 and dropped
    got = scene.forward(backend, items + q_pad, fb)[: len(items)]
    eager = scene.run(det() if deterministic else backend, items, decode=True)
    for g, e in zip(got, eager):
        if deterministic:
            assert torch.equal(g, e)
        else:
            assert (g - e).abs().max().item() <= 1e-5
