"""The tiny-model builder: HF loads its output, it is deterministic, and its logits are usable."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.testing.tiny_model import build_tiny_model, tiny_model_path
from engine.tokenizer import apply_chat_template

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！机器学习是人工智能的一个分支。",
    "emoji: 😀🚀❤️👍🏽 and 🇫🇷 flags",
    "def f(x):\n\treturn x ** 2  # 42\n\n",
    "mixed: café, Straße, Привет, مرحبا, こんにちは, 안녕하세요 … ∑√π",
    "  leading and trailing spaces  ",
]


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_writes_hf_checkpoint_files(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["vocab_size"] % 64 == 0 and config["tie_word_embeddings"] is True


def test_hf_loads_model_and_tokenizer(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert model.config.vocab_size >= len(tok)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_generation_config_stops_on_chat_end(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    assert "temperature" not in gen  # the tiny model is greedy unless asked otherwise


def test_deterministic_for_a_seed(tiny, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny)
    other = _digests(build_tiny_model(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != _digests(tiny)["model.safetensors"]
    assert other["tokenizer.json"] == _digests(tiny)["tokenizer.json"]


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(tiny, text):
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_chat_template_renders(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = apply_chat_template(tok, messages)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_logits_are_peaked_and_not_degenerate(tiny):
    """Greedy comparisons against HF need top-1/top-2 gaps far above float32 noise."""
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 128), generator=gen)
    with torch.no_grad():
        top2 = model(ids).logits.float().topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.1
    assert (gaps < 1e-3).float().mean() < 0.01
    with torch.no_grad():
        out = model.generate(ids[:, :16], max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    distinct = [len(set(row[16:].tolist())) for row in out]
    assert min(distinct) > 4, distinct


@pytest.mark.parametrize("preset,shape", [
    ("qwen3-0.6b", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                        vocab_size=151936, tie_word_embeddings=True)),
    ("qwen3-8b", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                      vocab_size=151936, tie_word_embeddings=False)),
])
def test_real_shape_presets_write_config_only(tmp_path, preset, shape):
    out = build_tiny_model(tmp_path, preset=preset)
    assert not (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in shape} == shape
    assert config["max_position_embeddings"] == 40960 and config["rope_theta"] == 1000000.0
    assert config["torch_dtype"] == "bfloat16"
    hf = AutoConfig.from_pretrained(out)
    assert hf.num_hidden_layers == shape["num_hidden_layers"]
    assert AutoTokenizer.from_pretrained(out).decode([]) == ""


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        build_tiny_model(tmp_path, preset="gpt-5")


def test_cached_path_builds_once(tmp_path):
    first = tiny_model_path(cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = tiny_model_path(cache_dir=tmp_path)
    assert second == first and (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny_model_path(cache_dir=tmp_path, seed=1) != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
