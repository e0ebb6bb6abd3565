"""FlashInfer attention on the GPU at the Qwen3-8B attention shape (32 q heads, 8 kv heads, D=128)
in bf16: against the torch oracle on a mixed batch (cached prefixes, a chunk over a prefix), on a
chunked prefill and over 64 decode steps; decode under a CUDA graph replayed at new lengths; and
the engine end to end against the triton backend. The first run JIT-compiles flashinfer's
kernels (about a minute; cached under ~/.cache/flashinfer). Run with -s to see the timings.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

from engine.attention.flashinfer import FlashInferAttentionBackend  # noqa: E402
from engine.attention.torch_native import TorchNativeAttentionBackend  # noqa: E402
from engine.testing.attention_scene import (  # noqa: E402
    LENS, MIXED, cuda_timer as timed, qwen3_8b_scene, rel_err, worst_mixed_then_decode, worst_vs_torch)

@pytest.fixture(scope="module")
def scene():
    return qwen3_8b_scene()


def test_kv_indices_kernel():
    from engine.kernels.kv_indices import build_kv_indices

    r2t = torch.randint(0, 1 << 30, (9, 5000), device="cuda")
    rows = torch.tensor([3, 0, 8, 1], device="cuda")
    lens = torch.tensor([1, 4100, 513, 512], device="cuda")
    indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
    out = torch.full((int(indptr[-1]) + 5,), -1, dtype=torch.int32, device="cuda")
    build_kv_indices(r2t, rows, lens, indptr, out)
    ref = torch.cat([r2t[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]).to(torch.int32)
    assert torch.equal(out[:-5], ref) and bool((out[-5:] == -1).all())


def test_extend_and_64_decode_steps_match_torch(scene):
    with timed("vs torch (first call JIT-compiles)"):
        mixed, decode = worst_mixed_then_decode(scene, FlashInferAttentionBackend())
        assert mixed <= 1e-2
        assert decode <= 1e-2


def test_chunked_prefill_matches_torch(scene):
    """Each chunk of a prefill, batched with another prompt, against the oracle and the whole."""
    fi = FlashInferAttentionBackend()
    seq, length = 2, LENS[2]
    whole = scene.run(fi, [(seq, 0, length)])[0]
    cuts = [0, 333, 1000, 1024, 1500, length]
    chunks = []
    for a, b in zip(cuts, cuts[1:]):
        items = [(seq, a, b - a), (0, 0, 300)]
        assert worst_vs_torch(scene, fi, items) <= 1e-2
        chunks.append(scene.run(fi, items)[0])
    assert rel_err(torch.cat(chunks), whole) <= 1e-2


def test_strided_q_views_of_the_qkv_output(scene):
    """q, k, v as views into one [T, H + 2 Hkv, D] tensor, as a fused qkv projection gives them."""
    fi = FlashInferAttentionBackend()
    for items, decode in ((MIXED, False), ([(s, n - 1, 1) for s, n in enumerate(LENS)], True)):
        fb = scene.batch(fi, items, decode)
        fi.init_forward_metadata(fb)
        q, k, v = [torch.cat([getattr(scene, n)[s][a:a + c] for s, a, c in items]) for n in "qkv"]
        qkv = torch.cat([q, k, v], dim=1)
        out = fi.forward(qkv[:, :32], qkv[:, 32:40], qkv[:, 40:], 0, 128**-0.5, fb)
        ref = torch.cat(scene.run(TorchNativeAttentionBackend(), items, decode))
        assert rel_err(out, ref) <= 1e-2


def test_decode_under_cuda_graph(scene):
    """bs 3 padded to 4 and captured; replayed at the capture lengths and then at other
    sequences and lengths (static inputs rewritten in place): the rows equal eager's."""
    with timed("cuda graph decode"):
        fi = FlashInferAttentionBackend()
        fi.init_cuda_graph_state(8, max(LENS) + 1, 32, 8, 128, torch.device("cuda"))
        pad = [(3, 0, 1)]  # a 4th row to pad with (pointed at row 0, slot 0 below)

        def static_batch(items):
            fb = scene.batch(fi, items + pad, decode=True)
            fb.req_pool_indices[3], fb.seq_lens[3], fb.out_cache_loc[3] = 0, 1, 0
            return fb

        def qkv(items):
            return [torch.cat([getattr(scene, n)[s][a:a + 1] for s, a, _ in items + pad]) for n in "qkv"]

        first = [(s, n - 40, 1) for s, n in enumerate(LENS[:3])]
        fb = static_batch(first)
        q, k, v = qkv(first)
        fi.init_forward_metadata_capture(4, fb.req_pool_indices, fb.seq_lens)
        fi.forward(q, k, v, 0, 128**-0.5, fb)  # warm-up: compiles and plans outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fi.forward(q, k, v, 0, 128**-0.5, fb)
        second = [(3, LENS[3] - 1, 1), (5, LENS[5] - 1, 1), (1, LENS[1] - 7, 1)]
        for items in (first, second):
            new = static_batch(items)  # also writes the items' cached prefixes to the pool
            for static, value in ((fb.req_pool_indices, new.req_pool_indices), (fb.seq_lens, new.seq_lens),
                                  (fb.out_cache_loc, new.out_cache_loc)):
                static.copy_(value)
            for static, value in zip((q, k, v), qkv(items)):
                static.copy_(value)
            fi.init_forward_metadata_replay(4, fb.req_pool_indices, fb.seq_lens,
                                            new.seq_lens_cpu[:3] + [1])
            graph.replay()
            torch.cuda.synchronize()
            eager = scene.run(TorchNativeAttentionBackend(), items, decode=True)
            for i, ref in enumerate(eager):
                assert rel_err(out[i:i + 1], ref) <= 1e-2, (items[i], rel_err(out[i:i + 1], ref))


# ---- the engine end to end -----------------------------------------------------------------------
MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny_hd128(tmp_path_factory) -> str:
    """The tiny model with head_dim 128: flashinfer's kernels need head_dim a multiple of 64."""
    from engine.testing import tiny_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny_model.PRESETS, "tiny", {**tiny_model.PRESETS["tiny"], "head_dim": 128})
        return str(tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny128"), preset="tiny"))


def generate(model_path: str, backend: str) -> tuple[list[dict], int]:
    from engine import Engine

    eng = Engine(model_path=model_path, device="cuda", dtype="bfloat16", attention_backend=backend,
                 cuda_graph_max_bs=8, chunked_prefill_size=64, max_total_tokens=16384)
    try:
        vocab = eng.local_core.parts.vocab_size
        rng = random.Random(0)
        params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
        outs, last = [], []
        for bs in (1, 3, 9):  # 9 > cuda_graph_max_bs: that batch decodes eagerly
            last = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 200))] for _ in range(bs)]
            outs += eng.generate(input_ids=last, sampling_params=params, return_logprob=True,
                                 top_logprobs_num=2)
        # shared prefixes: the radix cache turns these into extends over cached tokens
        again = [p[: len(p) // 2] + [rng.randrange(3, vocab) for _ in range(9)] for p in last]
        outs += eng.generate(input_ids=again, sampling_params=params, return_logprob=True,
                             top_logprobs_num=2)
        graphs = eng.local_core.parts.runner.cuda_graph
        assert graphs is not None
        return outs, graphs.num_replays
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def test_engine_greedy_matches_triton(tiny_hd128):
    with timed("engine: flashinfer vs triton"):
        fi_outs, replays = generate(tiny_hd128, "flashinfer")
        tr_outs, _ = generate(tiny_hd128, "triton")
    assert replays >= MAX_NEW - 1
    diverged = 0
    for f, t in zip(fi_outs, tr_outs):
        ft, tt = f["output_ids"], t["output_ids"]
        n = next((i for i, (a, b) in enumerate(zip(ft, tt)) if a != b), len(tt))
        lp_f = [lp for lp, *_ in f["meta_info"]["output_token_logprobs"]][:n]
        lp_t = [lp for lp, *_ in t["meta_info"]["output_token_logprobs"]][:n]
        lp_diff = max((abs(a - b) for a, b in zip(lp_f, lp_t)), default=0.0)
        # bf16 attention summed in another order, compounded over up to 64 steps of a random-weight
        # model: 0.116 measured on the H200; a wrong mask or page table moves logprobs by nats
        assert lp_diff <= 0.25, f"logprobs differ by {lp_diff} before any token does"
        if n < len(tt):  # bf16 may flip a near-tie, nothing else
            top = t["meta_info"]["output_top_logprobs"][n]
            gap = top[0][0] - top[1][0]
            assert gap <= 0.1, f"token {n} differs though triton's top-2 gap is {gap:.3f}"
            diverged += 1
    # No bound on how many diverge: this random-weight bf16 model is full of near-ties (13 of 22
    # on the H200; HF vs tandem agree on 16% of greedy tokens in bf16). The checks above are what
    # a real fault fails: a token flipped where triton's top-2 gap is wide, or logprobs off by nats.
    print(f"  {diverged}/{len(tr_outs)} sequences diverged, each at a near-tie")


def test_cuda_core_decode_matches_torch(scene):
    """use_tensor_cores=False: flashinfer's CUDA-core decode kernel (its own JIT module)."""
    with timed("cuda-core decode (JIT-compiles another module)"):
        fi = FlashInferAttentionBackend(use_tensor_cores=False)
        items = [(s, n - 1, 1) for s, n in enumerate(LENS)]
        assert worst_vs_torch(scene, fi, items, decode=True) <= 1e-2
