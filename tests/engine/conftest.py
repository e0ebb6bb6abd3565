"""Shared fixtures: the tiny model (built once per session) and engines over it."""

from __future__ import annotations

import gc
import random

import pytest
import torch


def _built(tmp_path_factory, preset: str, seed: int = 0) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp(f"{preset}-{seed}"), preset=preset, seed=seed))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return _built(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """The tiny model's architecture and tokenizer with other weights: a weight update's source."""
    return _built(tmp_path_factory, "tiny", seed=1)


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE (4 experts, top-2, both layers sparse)."""
    return _built(tmp_path_factory, "tiny-moe")


@pytest.fixture(scope="session")
def moe_mixed_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen3-MoE with layer 1 dense (mlp_only_layers=[1])."""
    return _built(tmp_path_factory, "tiny-moe-mixed")


@pytest.fixture(scope="session")
def other_engine(other_model_dir):
    """An engine started on other_model_dir: the oracle for a weight update to those weights."""
    from engine import Engine

    eng = Engine(model_path=other_model_dir, dtype="float32", device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def engine_factory(tiny_model_dir):
    """Engines of one module, shut down when it ends (each holds ~160 MB on the CPU: KV pool and
    req_to_token table; a session of them grew the suite's process by many GB)."""
    from engine import Engine

    engines = []

    def make(**kwargs):
        kwargs = {"dtype": "float32", "device": "cpu", **kwargs}
        eng = Engine(model_path=tiny_model_dir, **kwargs)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()
    engines.clear()
    gc.collect()  # an EngineCore is a reference cycle: free its tensors now, not at some later collection


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, dtype="float32", device="cpu")
    yield eng
    eng.shutdown()


def random_prompts(n: int, vocab: int, lengths=(1, 120), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]
