"""The engine's own config.json reader against transformers' AutoConfig (the oracle): whenever it
takes a config as it stands, everything the engine reads off it is what AutoConfig would give;
a config that leaves a value to transformers' defaults goes to AutoConfig."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from engine.models.checkpoint_config import (CheckpointConfig, load_hf_config, read_checkpoint_json,
                                             read_stated_config)
from engine.models.decoder import head_dim_of
from engine.models.layers import RotaryEmbedding
from engine.models.loader import load_model, resolve_dtype
from engine.models.registry import model_class_for_config
from engine.testing.tiny_model import PRESETS, build_tiny_model
from tests.engine.test_models import CONFIGS

# (attribute, the default the engine's getattr uses) for every value a model or the core reads
READ = (("hidden_size", None), ("intermediate_size", None), ("num_attention_heads", None),
        ("num_hidden_layers", None), ("num_key_value_heads", None), ("rms_norm_eps", None), ("vocab_size", None),
        ("hidden_act", "silu"), ("max_position_embeddings", 4096), ("tie_word_embeddings", False),
        ("attention_bias", False), ("mlp_bias", False), ("qkv_bias", True), ("layer_types", None),
        ("num_experts", 0), ("num_experts_per_tok", None), ("moe_intermediate_size", None),
        ("norm_topk_prob", False), ("decoder_sparse_step", 1), ("mlp_only_layers", None),
        ("shared_expert_intermediate_size", 0), ("eos_token_id", None))
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def engine_view(config) -> dict:
    view = {name: getattr(config, name, default) for name, default in READ}
    view["mlp_only_layers"] = list(view["mlp_only_layers"] or [])
    view["layer_types"] = "sliding_attention" in (view["layer_types"] or [])  # all the decoder asks of it
    rope = RotaryEmbedding.from_config(config, head_dim_of(config))
    view.update(head_dim=head_dim_of(config), inv_freq=rope.inv_freq.tolist(), cls=model_class_for_config(config),
                dtype=resolve_dtype("auto", config, "cuda"))
    return view


def _write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_read_without_transformers_and_agree(tmp_path, preset):
    path = _write_config(tmp_path, json.loads(_preset_config_json(tmp_path / "built", preset)))
    fast = read_stated_config(str(path))
    assert isinstance(fast, CheckpointConfig), "every preset states all it needs: no AutoConfig at start-up"
    assert engine_view(fast) == engine_view(transformers.AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_configs_saved_by_transformers_agree_when_taken(tmp_path, kind):
    config = CONFIGS[kind]()
    config.architectures = [ARCHITECTURES[kind]]
    config.save_pretrained(tmp_path)
    fast = read_stated_config(str(tmp_path))
    if fast is not None:
        assert engine_view(fast) == engine_view(transformers.AutoConfig.from_pretrained(tmp_path))
    assert engine_view(load_hf_config(str(tmp_path))) == engine_view(transformers.AutoConfig.from_pretrained(tmp_path))


def test_a_value_left_to_transformers_defaults_goes_to_autoconfig(tmp_path):
    config = json.loads(_preset_config_json(tmp_path / "built", "qwen3-8b"))
    del config["head_dim"]  # Qwen3's default is 128, not hidden_size / heads
    config["hidden_size"] = 2048
    path = _write_config(tmp_path / "nohead", config)
    assert read_stated_config(str(path)) is None
    assert head_dim_of(load_hf_config(str(path))) == 128


def test_llama_without_head_dim_is_read_as_transformers_reads_it(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 512, "hidden_act": "silu", "max_position_embeddings": 256,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}, "eos_token_id": [1, 2]}
    path = _write_config(tmp_path, config)
    fast = read_stated_config(str(path))
    assert fast is not None and head_dim_of(fast) == 16
    assert engine_view(fast) == engine_view(transformers.AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("change", [{"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                                    {"use_sliding_window": True}])
def test_unknown_types_and_derived_sliding_layers_go_to_autoconfig(tmp_path, change):
    config = dict(json.loads(_preset_config_json(tmp_path / "built", "tiny")), **change)
    assert read_stated_config(str(_write_config(tmp_path / "cfg", config))) is None


def test_sliding_layers_are_still_refused_by_name(tmp_path):
    config = dict(json.loads(_preset_config_json(tmp_path / "built", "tiny")), use_sliding_window=True,
                  max_window_layers=0, sliding_window=8)
    path = _write_config(tmp_path / "cfg", config)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(str(path), load_hf_config(str(path)), torch.float32, "cpu", "dummy")


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe-mixed"])
def test_the_model_built_from_either_reader_is_the_same(tmp_path, preset):
    path = str(build_tiny_model(tmp_path, preset))
    fast = load_model(path, read_stated_config(path), torch.float32, "cpu", "auto")
    oracle = load_model(path, transformers.AutoConfig.from_pretrained(path), torch.float32, "cpu", "auto")
    fast_state, oracle_state = fast.state_dict(), oracle.state_dict()
    assert fast_state.keys() == oracle_state.keys()
    assert all(torch.equal(fast_state[k], oracle_state[k]) for k in fast_state)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2")
    assert read_checkpoint_json(str(tmp_path), "generation_config.json") == {}
    (tmp_path / "config.json").write_text("[1, 2]")
    assert read_stated_config(str(tmp_path)) is None


def test_the_engine_core_starts_without_importing_transformers(tmp_path):
    path = build_tiny_model(tmp_path, "tiny")
    code = ("import sys; from engine.config import ServerArgs; from engine.core.setup import build_core_parts; "
            f"parts = build_core_parts(ServerArgs(model_path={str(path)!r}, skip_tokenizer_init=True, "
            "cuda_graph_max_bs=0)); print(parts.eos_token_ids, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "False", out.stdout
    eos: set[int] = set()
    for value in (transformers.AutoConfig.from_pretrained(path).eos_token_id,
                  transformers.GenerationConfig.from_pretrained(path).eos_token_id):
        eos.update(value if isinstance(value, list) else [value] if value is not None else [])
    assert out.stdout.startswith(str(tuple(sorted(eos)))), out.stdout


def _preset_config_json(out: Path, preset: str) -> str:
    """The config.json `tandem tiny-model` writes for `preset`."""
    return (build_tiny_model(out, preset) / "config.json").read_text()
