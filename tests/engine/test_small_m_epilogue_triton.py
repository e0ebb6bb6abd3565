"""small_m_linear's fusions under Triton's CPU interpreter: the activation in the gemv's prologue
(`gated`) and the residual add + RMSNorm in its split-K reduction (`small_m_linear_add_norm`),
against the launches they replace and a float64 reference; and a decoder taking them end to end
(the GPU runs them in tests/gpu/test_decode_kernels_gpu.py). Skipped where triton is absent and
on CUDA machines."""

from __future__ import annotations

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
triton = import_triton_or_skip()

from engine.kernels.batch_invariant.triton_norm import rms_norm  # noqa: E402
from engine.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from engine.kernels.small_m_linear import GemvConfig, small_m_linear, small_m_linear_add_norm  # noqa: E402

SPLIT = GemvConfig(16, 32, 4)  # four K splits: the reduction kernel runs
DIRECT = GemvConfig(32, 32, 1)  # one split: the gemv writes y, the norm is its own launch


def _inputs(m: int, n: int, k: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    return bf(m, k), bf(n, k, scale=0.2), bf(n) if bias else None, bf(m, n), bf(n, scale=0.5) + 1


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("config", [SPLIT, DIRECT])
def test_gated_gemv_is_silu_and_mul_then_the_gemv(m, config):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 2 * 128, generator=g) * 2).to(torch.bfloat16)  # gate | up
    w = (torch.randn(48, 128, generator=g) * 0.2).to(torch.bfloat16)
    act = silu_and_mul(x, stepwise=False)
    fused = small_m_linear(x, w, config=config, gated=True)
    torch.testing.assert_close(fused.double(), act.double() @ w.double().T, atol=0.03, rtol=0.01)
    torch.testing.assert_close(fused, small_m_linear(act, w, config=config), atol=0.0, rtol=0.008)  # an ulp
    with pytest.raises(ValueError, match="gated: x is gate | up"):
        small_m_linear(act, w, gated=True)  # K wide: not gate | up


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config", [SPLIT, DIRECT])  # DIRECT: the fallback (the norm's own launch); float64 checks it
@pytest.mark.parametrize("bias", [False, True])
def test_add_norm_epilogue_matches_linear_then_norm(m, config, bias):
    x, w, b, residual, norm_w = _inputs(m, 80, 128, seed=m, bias=bias)
    normed, summed = small_m_linear_add_norm(x, w, b, residual, norm_w, 1e-6, config=config)
    ref_normed, ref_sum = rms_norm(small_m_linear(x, w, b, config), norm_w, 1e-6, residual)
    assert torch.equal(summed, ref_sum)  # y rounded, then y + residual rounded: the same bits
    torch.testing.assert_close(normed, ref_normed, atol=0.0, rtol=0.008)  # the norm's sum order: an ulp
    z = (x.double() @ w.double().T + (b.double() if bias else 0) + residual.double())
    ref = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    torch.testing.assert_close(normed.double(), ref, atol=0.05, rtol=0.02)
    again = small_m_linear_add_norm(x, w, b, residual, norm_w, 1e-6, config=config)
    assert torch.equal(again[0], normed) and torch.equal(again[1], summed)  # run to run


def test_add_norm_refuses_a_residual_of_another_shape():
    x, w, _, residual, norm_w = _inputs(2, 80, 128, seed=0)
    with pytest.raises(ValueError, match="residual"):
        small_m_linear_add_norm(x, w, None, residual[:, :40], norm_w, 1e-6)


class _QAsAttention:
    """An attention backend that returns q: the decoder's wiring without a KV cache."""

    def forward(self, q, k, v, layer_id, scaling, forward_batch):
        return q


def _tiny_bf16_qwen3(tmp_path):
    import transformers

    from engine.models.loader import load_model

    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return load_model(str(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path), torch.bfloat16, "cpu", "auto")


@pytest.mark.parametrize("gated", [False, True])  # the default ("norm"), and with the activation prologue
def test_decoder_takes_the_fused_epilogues(tmp_path, monkeypatch, gated):
    """A bf16 decoder at 2 rows with the fusions (the interpreter standing in for CUDA): every
    o_proj and down_proj runs them, and the hidden states agree with the layers run one by one
    to the rounding of the norm's sum."""
    from types import SimpleNamespace

    from engine.kernels import small_m_linear as sml
    from engine.models import layers

    model = _tiny_bf16_qwen3(tmp_path)
    assert sml.choose_config(64, 512).split_k > 1  # down_proj's reduction kernel runs (o_proj's K = 64: one split)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(sml, "EPILOGUE_ENABLED", True)
    monkeypatch.setattr(sml, "GATED_PROLOGUE", gated)
    calls = []
    real = sml.small_m_linear_add_norm
    monkeypatch.setattr(sml, "small_m_linear_add_norm", lambda *a, **k: calls.append(k["gated"]) or real(*a, **k))
    ids, positions = torch.tensor([3, 77]), torch.tensor([5, 9])
    fb = SimpleNamespace(attn_backend=_QAsAttention(), lora=None)
    with torch.inference_mode():
        fused = model.model(ids, positions, fb)
        assert sorted(calls) == sorted([False, gated] * 2)  # 2 layers: o_proj, then down_proj (+ the activation)
        monkeypatch.setattr(layers.Linear, "small_m_epilogue", False)
        plain = model.model(ids, positions, fb)
    assert len(calls) == 4  # the unfused run took none
    torch.testing.assert_close(fused.float(), plain.float(), atol=0.02, rtol=0.02)
    assert not torch.equal(fused, torch.zeros_like(fused))


def test_epilogue_variable_refuses_an_unknown_value():
    """"off" is no value of TANDEM_SMALL_M_EPILOGUE: an error naming the three, not the slower prologue."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "import engine.kernels.small_m_linear"], capture_output=True, text=True,
                         env={**os.environ, "TANDEM_SMALL_M_EPILOGUE": "off", "TRITON_INTERPRET": "1"})
    assert run.returncode != 0 and "use norm (the default), 1 or 0" in run.stderr
