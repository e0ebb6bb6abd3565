"""MoE in the bench: the roofline counts active params and the experts a decode step touches;
the engine's weights copy into HF transformers' fused-expert Qwen3MoeForCausalLM."""

from __future__ import annotations

import pytest
import torch


def _meta_model(preset: str, tmp_path):
    from transformers import AutoConfig

    from engine.models.registry import model_class_for_config
    from engine.testing.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / preset, preset=preset)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = model_class_for_config(config)(config)
        finally:
            torch.set_default_dtype(torch.float32)
    return model, config


def test_qwen3_30b_a3b_roofline_counts_active_and_touched_experts(tmp_path):
    from tandem.bench.roofline import model_shape

    model, config = _meta_model("qwen3-30b-a3b", tmp_path)
    shape = model_shape(model, config, kv_bytes_per_token=48 * 2 * 4 * 128 * 2)
    total = sum(p.numel() for p in model.parameters())
    assert 30.0e9 < total < 31.0e9  # Qwen3-30B-A3B: 30.5B parameters
    assert shape.num_experts == 128 and shape.top_k == 8
    assert shape.expert_params == 48 * 128 * 3 * 2048 * 768
    active = shape.active_matmul_params() + model.model.embed_tokens.weight.numel()
    assert 3.2e9 < active < 3.5e9  # "A3B": 3.3B activated
    assert shape.step_weight_bytes(1) == pytest.approx(shape.decode_weight_bytes - shape.expert_bytes * 120 / 128)
    assert shape.step_weight_bytes(256) == pytest.approx(shape.decode_weight_bytes, rel=1e-6)  # all touched


def test_engine_weights_copy_into_hf_fused_experts(moe_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.loader import load_model
    from tandem.bench.hf_weights import copy_into_hf

    config = AutoConfig.from_pretrained(moe_dir)
    engine_model = load_model(moe_dir, config, torch.float32, "cpu", "auto")
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    copy_into_hf(engine_model, hf)
    reference = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(hf.state_dict()[name], tensor), name


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("moe"), preset="tiny-moe-mixed"))
