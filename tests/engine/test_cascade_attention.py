"""Shared-prefix (cascade) decode under the Triton interpreter on the CPU, against the torch oracle.

Rows that share a cached prefix (the same slots, as the radix cache gives GRPO's samples) decode
through phase A (the shared keys, one K/V read per block of rows) and phase B (each row's own
keys); the result must be the plain attention of each row over all of its keys, with the
partials merged in the program (few SMs) or by stage 2 (many), eagerly and from a CUDA graph's
static tables with padding rows. Skipped where triton is absent and on CUDA machines.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton")

from engine.attention.cascade import GRAPH_MIN_BS  # noqa: E402
from engine.attention.shared_prefix import shared_prefix_plan  # noqa: E402
from engine.attention.torch_native import TorchNativeAttentionBackend  # noqa: E402
from engine.attention.triton import TritonAttentionBackend  # noqa: E402
from engine.testing.attention_scene import AttentionScene as Scene  # noqa: E402

# sequences 0-4 share 70 keys of sequence 0, 5-6 share 33 of sequence 5, 7 stands alone
LENS = [90, 75, 100, 71, 88, 60, 45, 50]


def shared_scene(heads=4, kv_heads=2):
    scene = Scene(LENS, heads=heads, kv_heads=kv_heads, head_dim=16, seed=3)
    scene.share_prefix(0, [1, 2, 3, 4], 70)
    scene.share_prefix(5, [6], 33)
    return scene


def decode_items(seqs=range(len(LENS))):
    return [(s, LENS[s] - 1, 1) for s in seqs]


def with_plan(scene, backend, items):
    fb = scene.batch(backend, items, decode=True)
    fb.shared_prefix = shared_prefix_plan(scene.r2t.req_to_token, fb.req_pool_indices.tolist(),
                                          fb.seq_lens_cpu, min_shared_len=8, min_saved_keys=1)
    return fb


def assert_matches_torch(scene, got, items):
    ref = scene.run(TorchNativeAttentionBackend(), items, decode=True)
    for g, r in zip(got, ref):
        assert (g - r).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_sms", [1, 64], ids=["merge", "partials"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1)], ids=["gqa2", "gqa8"])
def test_cascade_decode_matches_torch(num_sms, heads, kv_heads):
    """gqa8: 8 rows a block, so the five-row group fits one block; gqa2: 32 rows a block."""
    scene = shared_scene(heads, kv_heads)
    backend = TritonAttentionBackend(num_sms=num_sms)
    backend.cascade.group = heads // kv_heads  # the model's heads, as a first forward tells it
    items = decode_items()
    fb = with_plan(scene, backend, items)
    assert fb.shared_prefix.lens == [70, 33]
    backend.init_forward_metadata(fb)
    assert backend.cascade_tables is not None
    assert_matches_torch(scene, scene.forward(backend, items, fb), items)


def test_groups_wider_than_a_block(monkeypatch):
    """16 query heads on one kv head: 4 rows a block, so the group of five is cut in two. Phase A
    with a program per block, then with one program taking all three in turn: the same bits."""
    import engine.kernels.shared_prefix_attention as phase_a

    scene = shared_scene(16, 1)
    items = decode_items()
    outs = []
    for programs in (phase_a.MAX_PROGRAMS, 1):
        monkeypatch.setattr(phase_a, "MAX_PROGRAMS", programs)
        backend = TritonAttentionBackend(num_sms=1)
        backend.cascade.group = 16
        assert backend.cascade.members() == 4
        fb = with_plan(scene, backend, items)
        backend.init_forward_metadata(fb)
        assert backend.cascade_tables.num_blocks == 3  # 3 + 2 rows, then the pair
        outs.append(scene.forward(backend, items, fb))
        assert_matches_torch(scene, outs[-1], items)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_without_a_plan_or_in_deterministic_mode_nothing_changes():
    scene = shared_scene()
    items = decode_items()
    plain = TritonAttentionBackend(num_sms=1, cascade=False)
    assert plain.cascade is None and not plain.wants_shared_prefix
    assert TritonAttentionBackend(deterministic=True).cascade is None
    backend = TritonAttentionBackend(num_sms=1)
    backend.cascade.group = 2
    fb = scene.batch(backend, items, decode=True)  # no plan: every row reads all its keys
    backend.init_forward_metadata(fb)
    assert backend.cascade_tables is None
    got = scene.forward(backend, items, fb)
    for g, p in zip(got, scene.run(plain, items, decode=True)):
        assert torch.equal(g, p)


@pytest.mark.parametrize("programs", [2, 32], ids=["strided", "one_each"])
@pytest.mark.parametrize("num_sms", [1, 64], ids=["merge", "partials"])
def test_graph_tables_with_padding_rows(num_sms, programs, monkeypatch):
    """A graph of GRAPH_MIN_BS rows replayed for 8 rows, with the plan, then without one (phase
    A's programs: 2 taking every other of the table's 16 columns, or one a column)."""
    monkeypatch.setattr("engine.kernels.shared_prefix_attention.MAX_PROGRAMS", programs)
    scene = shared_scene()
    backend = TritonAttentionBackend(num_sms=num_sms)
    padded = GRAPH_MIN_BS
    backend.init_cuda_graph_state(padded, max(LENS) + 1, 4, 2, 16, torch.device("cpu"))
    items = decode_items()
    pad = padded - len(items)
    for shared in (True, False, True):
        fb = with_plan(scene, backend, items) if shared else scene.batch(backend, items, decode=True)
        req = torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
        seq_lens = torch.cat([fb.seq_lens, torch.ones(pad, dtype=torch.int64)])
        backend.init_forward_metadata_capture(padded, req, seq_lens)
        backend.init_forward_metadata_replay(padded, req, seq_lens, shared_prefix=fb.shared_prefix)
        assert backend.cascade_tables is not None  # captured with phase A, plan or not
        assert int(backend.cascade_tables.prefix_lens.sum()) == (70 * 5 + 33 * 2 if shared else 0)
        fb.req_pool_indices, fb.seq_lens = req, seq_lens
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
        got = scene.forward(backend, items + [(0, 0, 1)] * pad, fb)[: len(items)]
        assert_matches_torch(scene, got, items)


def _grpo_outputs(eng, prompts, samples):
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, "n": samples}
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return ([o["output_ids"] for o in outs],
            [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_grpo_batch_equals_plain_decode(engine_factory, graphs):
    """2 prompts x 8 samples through the engine (tiny model, float32): cascade decode's tokens
    and logprobs are plain decode's; the runner planned shared prefixes for the batch."""
    from engine.attention.shared_prefix import SharedPrefixFinder
    from tests.engine.conftest import random_prompts
    from tests.engine.test_cuda_graph_runner_cpu import EagerGraphRunner

    plain = engine_factory(attention_backend="triton", disable_cascade_attn=True)
    eng = engine_factory(attention_backend="triton")
    runner = eng.local_core.parts.runner
    assert plain.local_core.parts.runner.shared_prefix is None and runner.attn_backend.cascade is not None
    plans = []
    finder = SharedPrefixFinder(min_shared_len=8, min_saved_keys=1)  # the tiny batch's sharing counts
    find = finder.find
    runner.shared_prefix = finder
    finder.find = lambda *a: plans.append(find(*a)) or plans[-1]
    if graphs:
        runner.cuda_graph = EagerGraphRunner(runner.model, runner.attn_backend, runner.kv_pool,
                                             runner.req_to_token, runner.device, max_bs=16)
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(40, 70), seed=5)
    want = _grpo_outputs(plain, prompts, 8)
    got = _grpo_outputs(eng, prompts, 8)
    assert got[0] == want[0]
    assert max(abs(x - y) for g, w in zip(got[1], want[1]) for x, y in zip(g, w)) <= 1e-5
    shared = [p for p in plans if p is not None]
    assert shared and max(len(p.rows) for p in shared) == 16  # every sample decoded in a group
    if graphs:
        assert runner.cuda_graph.num_replays > 0
    eng.check_integrity()
