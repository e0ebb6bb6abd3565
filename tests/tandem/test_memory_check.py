"""A real-shape model on the CPU that cannot fit in RAM is refused up front, with a KV size that fits
(it thrashed for minutes, then the OOM killer ended `tandem train --model qwen3-0.6b` silently).

Oracle: Qwen3-0.6B's config (28 layers, 8 KV heads of 128): float32 KV is 2 x 28 x 8 x 128 x 4 =
229,376 bytes a token, so the CPU default pool of 65,536 tokens is 14.0 GiB; its 596,049,920
parameters are 2.2 GiB of float32 weights, and the trainer holds 4 copies (8.9 GiB)."""

from __future__ import annotations

import re

import pytest

from tandem.rl import memory_check
from tandem.rl.memory_check import GIB, check_cpu_memory
from recipes.recipe import Recipe


@pytest.fixture(scope="module")
def qwen_config_dir() -> str:
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path(preset="qwen3-0.6b"))  # config + tokenizer only


def test_a_model_too_large_for_ram_is_refused_with_a_kv_size_that_fits(monkeypatch, qwen_config_dir):
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 16 * GIB)
    recipe = Recipe(model="qwen3-0.6b", num_engines=1)
    with pytest.raises(ValueError) as exc:
        check_cpu_memory(recipe, qwen_config_dir)
    text = str(exc.value)
    assert text.startswith("model 'qwen3-0.6b' on the CPU needs about 25.1 GiB (trainer 8.9: weights, gradients, "
                           "AdamW moments; 1 engine(s) x 16.2: weights + a KV cache of 65536 tokens) but 16.0 GiB "
                           "are free: set --engine-args '{\"max_total_tokens\": ")
    fits = int(re.search(r'"max_total_tokens": (\d+)', text).group(1))
    check_cpu_memory(Recipe(model="qwen3-0.6b", num_engines=1, engine_args={"max_total_tokens": fits}), qwen_config_dir)
    with pytest.raises(ValueError):  # 2 x 229,376 bytes x 1024 tokens more does not fit
        check_cpu_memory(Recipe(model="qwen3-0.6b", num_engines=1, engine_args={"max_total_tokens": fits + 2048}),
                         qwen_config_dir)


def test_no_kv_size_fits_when_the_weights_alone_do_not(monkeypatch, qwen_config_dir):
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 8 * GIB)
    with pytest.raises(ValueError, match=r"but 8.0 GiB are free: use a smaller --model \(tiny\), or a GPU$"):
        check_cpu_memory(Recipe(model="qwen3-0.6b"), qwen_config_dir)


def test_the_default_fits_and_the_cli_refuses_before_the_run_folder(monkeypatch, tmp_path):
    from tandem.main import main
    from engine.testing.tiny_model import tiny_model_path

    check_cpu_memory(Recipe(), str(tiny_model_path()))  # the tiny model: a few MiB
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 4 * GIB)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "qwen3-0.6b", "--engine-backend", "in_process", "--quiet", "--output-dir", str(out)])
    assert str(exc.value.code).startswith("tandem train: model 'qwen3-0.6b' on the CPU needs about 41.3 GiB")
    assert not out.exists()
