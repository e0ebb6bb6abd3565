"""An engine whose decoder layers take every fused kernel (Triton's CPU interpreter standing in for
CUDA, the tiny model in bfloat16, triton attention): q/k norm + rope writing K/V into the pool in
its own launch (store_kv never runs), and the small-M gemv's activation prologue and add + norm
epilogue on batches of <= 8 rows (the prologue is opt-in, turned on here). Its greedy tokens and logprobs against the same engine with the
layers' torch code. Skipped where triton is absent and on CUDA machines (tests/gpu run them
compiled)."""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 7]]


def _greedy(eng):
    outs = eng.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": 5},
                        return_logprob=True)
    return [o["output_ids"] for o in outs], [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def test_fused_layers_keep_the_tokens_and_never_store_kv_apart(engine_factory, monkeypatch):
    from engine.attention.triton import TritonAttentionBackend
    from engine.kernels import small_m_linear as sml
    from engine.kernels import store_kv as store_mod
    from engine.models import layers

    eng = engine_factory(dtype="bfloat16", attention_backend="triton", disable_cuda_graph=True)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(sml, "EPILOGUE_ENABLED", True)
    monkeypatch.setattr(sml, "GATED_PROLOGUE", True)  # opt-in (TANDEM_SMALL_M_EPILOGUE=1): every fusion
    calls = {"store_kv": 0, "epilogue": 0}
    real_store, real_epi = store_mod.store_kv, sml.small_m_linear_add_norm
    monkeypatch.setattr(store_mod, "store_kv", lambda *a: calls.__setitem__("store_kv", calls["store_kv"] + 1)
                        or real_store(*a))
    monkeypatch.setattr(sml, "small_m_linear_add_norm", lambda *a, **k: calls.__setitem__("epilogue", calls["epilogue"] + 1)
                        or real_epi(*a, **k))
    with monkeypatch.context() as apart:  # the same kernels, launched one by one
        apart.setattr(layers.Linear, "small_m_epilogue", False)
        apart.setattr(TritonAttentionBackend, "kv_store_slots", lambda self, layer_id, fb: None)
        want = _greedy(eng)
    assert calls["store_kv"] > 0 and calls["epilogue"] == 0
    calls.update(store_kv=0)
    got = _greedy(eng)
    assert calls["store_kv"] == 0 and calls["epilogue"] > 0
    assert got[0] == want[0]
    worst = max(abs(a - b) for ga, wa in zip(got[1], want[1]) for a, b in zip(ga, wa))
    # apart, the CPU's norms are torch's (another sum order than the epilogue's): an ulp of a bf16
    # hidden state here and there, an ulp of a bf16 logit (0.06 at 8-16) at most in the logprobs
    assert worst <= 0.13, worst
    eng.check_integrity()


def test_det_gemv_takes_the_linears_and_the_add_norm(engine_factory, monkeypatch):
    """Deterministic mode under TANDEM_DET_GEMV (engine/kernels/bi_gemv.py, the default): its small decode batches'
    linears run on the gemv with the matmul's K splits and o_proj / down_proj's add + norm in the
    split-K sum; the tokens are the batch-invariant path's (bit for bit is the GPU's test: on the CPU
    deterministic mode's linears are torch's tiles, which sum otherwise)."""
    from engine.kernels import bi_gemv
    from engine.kernels.batch_invariant import triton_ops
    from engine.models import layers

    eng = engine_factory(dtype="bfloat16", attention_backend="triton", disable_cuda_graph=True,
                         enable_deterministic_inference=True)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(bi_gemv, "BLOCK_K", 32)  # the tiny model's K (64, 128): two and four splits of 32
    for n, k in ((128, 64), (64, 64), (256, 64), (64, 128)):  # qkv, o, gate_up, down
        monkeypatch.setitem(triton_ops.CONFIG_TABLE, (n, k, "bf16"), triton_ops.MatmulConfig(block_k=32, split_k=32))
    calls = {"linear": 0, "add_norm": 0}
    real_linear, real_add_norm = bi_gemv.bi_gemv, bi_gemv.bi_gemv_add_norm
    monkeypatch.setattr(bi_gemv, "bi_gemv", lambda *a: calls.__setitem__("linear", calls["linear"] + 1) or real_linear(*a))
    monkeypatch.setattr(bi_gemv, "bi_gemv_add_norm",
                        lambda *a: calls.__setitem__("add_norm", calls["add_norm"] + 1) or real_add_norm(*a))
    monkeypatch.setattr(bi_gemv, "ENABLED", False)  # TANDEM_DET_GEMV=0: the batch-invariant matmul
    want = _greedy(eng)
    assert calls == {"linear": 0, "add_norm": 0}
    monkeypatch.setattr(bi_gemv, "ENABLED", True)  # the default
    got = _greedy(eng)
    assert calls["linear"] > 0 and calls["add_norm"] > 0
    assert got[0] == want[0]
    worst = max(abs(a - b) for ga, wa in zip(got[1], want[1]) for a, b in zip(ga, wa))
    assert worst <= 0.13, worst  # an ulp of a bf16 logit here and there (the CPU's other sums)
    eng.check_integrity()
