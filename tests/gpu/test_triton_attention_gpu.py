"""Triton attention on the GPU at the Qwen3-8B attention shape (32 q heads, 8 kv heads, D=128)
in bf16: against the torch oracle on a mixed batch (cached prefixes, a chunk over a prefix) and
over 64 decode steps; the deterministic properties bitwise; decode under a CUDA graph.
Run with -s to see the timings.
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from engine.attention.triton import TritonAttentionBackend  # noqa: E402
from engine.testing.attention_scene import (  # noqa: E402
    LENS, MIXED, cuda_timer as timed, qwen3_8b_scene, rel_err, worst_mixed_then_decode)

@pytest.fixture(scope="module")
def scene():
    return qwen3_8b_scene()


def backend(deterministic: bool) -> TritonAttentionBackend:
    return TritonAttentionBackend(deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["normal", "det"])
def test_extend_and_64_decode_steps_match_torch(scene, deterministic):
    with timed(f"vs torch, deterministic={deterministic}"):
        mixed, decode = worst_mixed_then_decode(scene, backend(deterministic))
        assert mixed <= 1e-2
        assert decode <= 1e-2


def test_batch_invariance_bitwise(scene):
    with timed("batch invariance"):
        tb = backend(True)
        for items, decode in ((MIXED, False), ([(s, n - 1, 1) for s, n in enumerate(LENS)], True)):
            together = scene.run(tb, items, decode)
            for item, rows in zip(items, together):
                assert torch.equal(scene.run(tb, [item], decode)[0], rows), (item, decode)
            # and in a batch with the order reversed and a sequence repeated
            again = scene.run(tb, list(reversed(items)) + [items[0]], decode)
            for rows, rows_again in zip(together, reversed(again[:-1])):
                assert torch.equal(rows, rows_again)


def test_chunked_prefill_and_prefill_equals_decode_bitwise(scene):
    with timed("chunking and prefill = decode"):
        tb = backend(True)
        seq, length = 2, LENS[2]
        whole = scene.run(tb, [(seq, 0, length)])[0]
        cuts = [0, 333, 1000, 1024, 1500, length]  # not aligned, except 1024
        chunks = [scene.run(tb, [(seq, a, b - a), (0, 0, 300)])[0] for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(chunks), whole)
        for pos in (0, 255, 256, 257, 511, 1023, 2047, length - 1):
            others = [(1, LENS[1] - 1, 1), (5, 300 + pos % 17, 1)][: 1 + pos % 2]
            decoded = scene.run(tb, [(seq, pos, 1)] + others, decode=True)[0]
            assert torch.equal(decoded[0], whole[pos]), pos


@pytest.mark.parametrize("deterministic", [False, True], ids=["normal", "det"])
def test_decode_under_cuda_graph(scene, deterministic):
    """bs 3 padded to 4 and captured: the replay gives the eager rows (bitwise when deterministic)."""
    with timed(f"cuda graph decode, deterministic={deterministic}"):
        tb = backend(deterministic)
        tb.init_cuda_graph_state(8, max(LENS) + 1, 32, 8, 128, torch.device("cuda"))
        items = [(s, n - 1, 1) for s, n in enumerate(LENS[:3])]
        eager = scene.run(backend(deterministic), items, decode=True)
        fb = scene.batch(tb, items + [(3, 0, 1)], decode=True)  # a 4th row to pad with
        fb.req_pool_indices[3], fb.seq_lens[3], fb.out_cache_loc[3] = 0, 1, 0
        tb.init_forward_metadata_capture(4, fb.req_pool_indices, fb.seq_lens)
        scene.forward(tb, items + [(3, 0, 1)], fb)  # warm-up compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = scene.forward(tb, items + [(3, 0, 1)], fb)
        tb.init_forward_metadata_replay(4, fb.req_pool_indices, fb.seq_lens)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(out[:3], eager):
            if deterministic:
                assert torch.equal(got, ref)
            else:
                assert rel_err(got, ref) <= 1e-2
