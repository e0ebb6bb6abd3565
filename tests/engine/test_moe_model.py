"""Qwen3-MoE on the CPU (float32): HF transformers' Qwen3MoeForCausalLM is the oracle.

Greedy tokens equal HF's for the all-sparse and the mixed (layer 1 dense) tiny models; the MoE
block's torch path equals HF's block; weights load, update, read and export under HF's
per-expert names (and load under transformers 5's fused names) through the one HF-name map.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import random_prompts

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


@pytest.fixture(scope="module")
def moe_engines(moe_model_dir, moe_mixed_model_dir):
    from engine import Engine

    engines = {name: Engine(model_path=path, dtype="float32", device="cpu")
               for name, path in (("sparse", moe_model_dir), ("mixed", moe_mixed_model_dir))}
    yield engines
    for eng in engines.values():
        eng.shutdown()


@pytest.mark.parametrize("kind", ["sparse", "mixed"])
def test_greedy_tokens_equal_hf(moe_engines, moe_model_dir, moe_mixed_model_dir, kind):
    hf = _hf(moe_model_dir if kind == "sparse" else moe_mixed_model_dir)
    eng = moe_engines[kind]
    prompts = random_prompts(4, hf.config.vocab_size, lengths=(1, 60), seed=3)
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)  # one batch: mixed prefill and decode
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == _hf_greedy(hf, prompt, GREEDY["max_new_tokens"])


def test_layer_kinds_follow_mlp_only_layers(moe_engines):
    from engine.models.decoder import MLP
    from engine.models.moe import SparseMoE

    kinds = {name: [type(layer.mlp) for layer in eng.local_core.runner.model.model.layers]
             for name, eng in moe_engines.items()}
    assert kinds == {"sparse": [SparseMoE, SparseMoE], "mixed": [SparseMoE, MLP]}


@pytest.mark.parametrize("deterministic", [False, True])
def test_moe_block_equals_hf_block(moe_engines, moe_model_dir, deterministic):
    hf_block = _hf(moe_model_dir).model.layers[0].mlp
    block = moe_engines["sparse"].local_core.runner.model.model.layers[0].mlp
    x = torch.randn(37, block.gate.in_features, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_ids = hf_block.gate(x)
    block.deterministic, was = deterministic, block.deterministic
    try:
        with torch.no_grad():
            ours, ref = block(x), hf_block(x[None])[0]
    finally:
        block.deterministic = was
    from engine.models.moe import route

    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_update_by_hf_names_equals_engine_on_new_checkpoint(moe_model_dir, tmp_path):
    from engine import Engine
    from engine.testing.tiny_model import build_tiny_model

    new_dir = str(build_tiny_model(tmp_path / "moe-b", preset="tiny-moe", seed=1))
    eng = Engine(model_path=moe_model_dir, dtype="float32", device="cpu")
    oracle = Engine(model_path=new_dir, dtype="float32", device="cpu")
    try:
        prompts = random_prompts(3, 1000, lengths=(5, 40), seed=1)
        before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        new = _tensors(new_dir)
        expert_names = [n for n in new if ".experts." in n]
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in expert_names and "model.layers.0.mlp.gate.weight" in new
        ok, message = eng.update_weights_from_tensor(list(new.items()), weight_version="moe-b")
        assert ok, message
        after = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after == [o["output_ids"] for o in oracle.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after != before
        # one expert's tensor alone updates just that slice, read back by its HF name
        name = "model.layers.0.mlp.experts.2.down_proj.weight"
        ok, message = eng.update_weights_from_tensor([(name, torch.full_like(new[name], 0.5))])
        assert ok, message
        assert eng.get_weights_by_name(name, truncate_size=2) == [[0.5] * new[name].shape[1]] * 2
        other = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert torch.tensor(eng.get_weights_by_name(other, truncate_size=3)).equal(new[other][:3])
        fused = torch.tensor(eng.get_weights_by_name("model.layers.0.mlp.experts.down_proj", truncate_size=2))
        assert fused.shape == (2, 64, 32) and fused[1].equal(new[other])  # transformers 5's name: all experts
    finally:
        eng.shutdown()
        oracle.shutdown()


def test_expert_shape_and_name_errors_are_named(moe_engines, moe_model_dir):
    eng = moe_engines["sparse"]
    tensors = _tensors(moe_model_dir)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    ok, message = eng.update_weights_from_tensor([(name, tensors[name][:, :32])])
    assert not ok and name in message and "shape [32, 32], expected [32, 64]" in message, message
    ok, message = eng.update_weights_from_tensor([("model.layers.0.mlp.experts.4.gate_proj.weight", tensors[name])])
    assert not ok and "experts.4.gate_proj" in message and "experts 0..3" in message, message
    assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]


def test_export_round_trips_and_fused_names_load(moe_engines, moe_model_dir):
    from engine.models.hf_names import HFNameMap

    model = moe_engines["sparse"].local_core.runner.model
    exported = dict(HFNameMap(model).hf_tensors(model.named_parameters()))
    on_disk = _tensors(moe_model_dir)
    assert exported.keys() == on_disk.keys()
    assert all(torch.equal(exported[n], on_disk[n]) for n in on_disk)
    # transformers 5 holds experts fused: its state_dict names load as whole stacked parameters
    hf_state = _hf(moe_model_dir).state_dict()
    fused = {n: t for n, t in hf_state.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(fused) == 4
    import copy

    clone = copy.deepcopy(model)
    clone.load_weights((n, 2 * t) for n, t in fused.items())
    assert torch.equal(clone.model.layers[1].mlp.experts.gate_up_proj.weight,
                       2 * hf_state["model.layers.1.mlp.experts.gate_up_proj"])
