"""The small-batch decode kernels on the GPU: small_m_linear against a float32 reference and
cuBLAS at the Qwen3-0.6B / 8B layer shapes, greedy_logprob against argmax + log_softmax, and an
engine at batch 1 that takes them (normal mode) giving HF's greedy tokens; gumbel_argmax against
the eager noise reference and in an engine. Speed: scripts/decode_kernels_bench.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.testing.triton_for_tests import import_compiled_triton_or_skip

pytestmark = pytest.mark.gpu
triton = import_compiled_triton_or_skip()

from engine.kernels.greedy_logprob import greedy_logprob  # noqa: E402
from engine.kernels.gumbel_argmax import gumbel_argmax  # noqa: E402
from engine.kernels.small_m_linear import small_m_linear, small_m_linear_add_norm  # noqa: E402
from engine.kernels.token_bitmask import masked_logits  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 12288)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 20, 32])  # past 16 rows: the 32-row tile, no PDL
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_m_linear_close_to_float32_and_cublas(n, k, m, dtype):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    ref = x.float() @ w.float().T + b.float()
    out = small_m_linear(x, w, b)
    cublas = F.linear(x, w, b)
    scale = ref.abs().max()
    # our error is that of cuBLAS's own output rounding
    assert (out.float() - ref).abs().max() <= 2 * (cublas.float() - ref).abs().max() + 1e-3 * scale
    assert torch.equal(out, small_m_linear(x, w, b))  # run to run
    assert torch.equal(out[:1], small_m_linear(x[:1], w, b))  # a row does not depend on the others here


# (out, in) of o_proj and down_proj: 0.6B, 8B
EPILOGUE_SHAPES = [(1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288)]


@pytest.mark.parametrize("n,k", EPILOGUE_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 8, 32])
@pytest.mark.parametrize("gated", [False, True])
def test_small_m_fused_epilogue_against_the_unfused_launches(n, k, m, gated):
    """small_m_linear_add_norm (+ the activation in the prologue) against silu_and_mul,
    small_m_linear and the Triton RMSNorm run one by one: the residual sum bit for bit, the normed
    output within an ulp (the norm's sum order), both close to a float32 reference."""
    from engine.kernels.batch_invariant.triton_norm import rms_norm
    from engine.kernels.silu_and_mul import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    bf = lambda *shape, s=1.0: (torch.randn(*shape, device="cuda", generator=g) * s).to(torch.bfloat16)  # noqa: E731
    x, w = bf(m, 2 * k if gated else k, s=2.0), bf(n, k, s=0.05)
    residual, norm_w = bf(m, n, s=4.0), bf(n, s=0.2) + 1
    act = silu_and_mul(x, stepwise=False) if gated else x
    normed, summed = small_m_linear_add_norm(x, w, None, residual, norm_w, 1e-6, gated=gated)
    ref_normed, ref_sum = rms_norm(small_m_linear(act, w), norm_w, 1e-6, residual)
    if not gated:  # (gated: the activation compiled into the gemv may round an input an ulp apart)
        assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(summed, ref_sum, atol=0.0, rtol=0.008)
    torch.testing.assert_close(normed, ref_normed, atol=0.0, rtol=0.016)
    z = act.float() @ w.float().T + residual.float()
    ref = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()
    torch.testing.assert_close(normed.float(), ref, atol=0.03, rtol=0.02)
    again = small_m_linear_add_norm(x, w, None, residual, norm_w, 1e-6, gated=gated)
    assert torch.equal(again[0], normed) and torch.equal(again[1], summed)  # run to run


@pytest.mark.parametrize("batch", [1, 5, 256])
def test_greedy_logprob_matches_torch(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, 151936, device="cuda", generator=g) * 4
    logits[0, 100] = logits[0, 151000] = logits[0].max() + 2  # a tie in different chunks
    ids, lp = greedy_logprob(logits)
    assert torch.equal(ids, torch.argmax(logits, dim=-1)) and ids[0] == 100
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(lp.double(), ref, atol=2e-6, rtol=1e-6)
    bf = logits.to(torch.bfloat16)  # half-precision logits read as they are
    ids_bf, lp_bf = greedy_logprob(bf)
    assert torch.equal(ids_bf, torch.argmax(bf.float(), dim=-1))
    torch.testing.assert_close(lp_bf.double(), torch.log_softmax(bf.double(), -1).gather(1, ids_bf[:, None]).squeeze(1),
                               atol=2e-6, rtol=1e-6)


def test_engine_batch_one_bf16_greedy_agrees_with_cublas_engine(tmp_path, monkeypatch):
    """A bf16 tiny model at batch 1 with graphs (small_m_linear + greedy_logprob) against the same
    engine with both kernels off: the same greedy tokens up to a first divergence, which may only
    sit at a near-tie (top-2 gap <= 0.05); logprobs before it within bf16 noise."""
    from engine import Engine
    from engine.kernels import small_m_linear as sml
    from engine.sampling import logprobs as lp_mod
    from engine.testing.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m"))

    def run(top: int):  # top logprobs keep the torch greedy path (top-1 == chosen bit for bit)
        eng = Engine(model_path=path, device="cuda", dtype="bfloat16", attention_backend="triton",
                     cuda_graph_max_bs=8, max_total_tokens=4096)
        try:
            assert eng.local_core.parts.runner.cuda_graph is not None
            return eng.generate(input_ids=[list(range(3, 40))], return_logprob=True, top_logprobs_num=top,
                                sampling_params={"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})[0]
        finally:
            eng.shutdown()

    new = run(0)
    monkeypatch.setattr(sml, "DISABLED", True)
    monkeypatch.setenv("TANDEM_DISABLE_FUSED_GREEDY", "1")
    lp_mod._greedy_kernel.cache_clear()
    try:
        old = run(2)
    finally:
        lp_mod._greedy_kernel.cache_clear()
    a, b = new["output_ids"], old["output_ids"]
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    lps = lambda o: [t[0] for t in o["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert max((abs(x - y) for x, y in zip(lps(new)[:n], lps(old)[:n])), default=0.0) < 0.05
    if n < len(a):
        top = old["meta_info"]["output_top_logprobs"][n]
        assert top[0][0] - top[1][0] <= 0.05, f"tokens part at step {n}, not a near-tie"


@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_gumbel_argmax_takes_the_eager_references_tokens(batch):
    """Element for element the eager noise (int64 hash, float64 -log(-log(u))): the same tokens
    at Qwen3's vocabulary, with a temperature-like spread and banned ids."""
    from engine.sampling.seeds import gumbel_argmax as eager

    g = torch.Generator(device="cuda").manual_seed(batch)
    logprobs = torch.log_softmax(torch.randn(batch, 151936, device="cuda", generator=g) * 3, dim=-1)
    logprobs[:, 5000:6000] = float("-inf")
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), device="cuda", generator=g)
    positions = torch.randint(0, 2**40, (batch,), device="cuda", generator=g)
    ids = gumbel_argmax(logprobs, seeds, positions)
    assert torch.equal(ids, eager(logprobs, seeds, positions))
    assert torch.equal(ids[-1:], gumbel_argmax(logprobs[-1:], seeds[-1:], positions[-1:]))  # batch-invariant


def test_engine_sampled_tokens_with_the_triton_gumbel_kernel(tmp_path, monkeypatch):
    """The Triton noise kernel (the default): an engine's seeded T=1 samples equal torch.compile's
    (TANDEM_TRITON_GUMBEL=0), batch 1 and 3."""
    from engine import Engine
    from engine.testing.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m"))
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}

    def run(kernel=None):
        eng = Engine(model_path=path, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096)
        try:
            if kernel is not None:  # it ran, not a fallback after a failed warm-up
                assert eng.local_core.parts.runner.sampler._compiled is kernel
            return [[o["output_ids"] for o in eng.generate(input_ids=[list(range(3, 20 + i)) for i in range(bs)],
                                                          sampling_params=params)] for bs in (1, 3)]
        finally:
            eng.shutdown()

    monkeypatch.setenv("TANDEM_TRITON_GUMBEL", "0")
    compiled = run()
    monkeypatch.delenv("TANDEM_TRITON_GUMBEL")
    assert run(gumbel_argmax) == compiled


@pytest.mark.parametrize("batch", [1, 64])
def test_masked_logits_equals_unpack_and_masked_fill(batch):
    """The grammar mask's one pass gives the torch path's values exactly at the Qwen vocabulary."""
    from engine.sampling.token_mask import masked_logits_torch

    vocab = 151936
    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, vocab, device="cuda", generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), device="cuda", generator=g,
                            dtype=torch.int32)
    assert torch.equal(masked_logits(logits, bitmask), masked_logits_torch(logits, bitmask))
