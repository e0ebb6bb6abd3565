"""SGLang's --sampling-defaults: chat completions take the sampling fields a request leaves unset
from the checkpoint's generation_config.json ("model", the default) or from OpenAI ("openai");
/v1/completions keeps its fixed defaults, as in SGLang.

Oracle: the same request with those values written out (same seed: the same tokens)."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.server.openai_protocol import ChatCompletionRequest, openai_sampling_params
from engine.server.served_model import model_sampling_defaults

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "seed": 3}


@pytest.fixture(scope="module")
def qwen3_defaults_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny checkpoint with Qwen3's published sampling defaults (and do_sample, which is not one)."""
    path = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **QWEN3, "do_sample": True}))
    return str(path)


def test_the_checkpoint_fields_fill_only_what_the_request_left_unset(qwen3_defaults_dir):
    defaults = model_sampling_defaults(qwen3_defaults_dir)
    assert defaults == QWEN3
    unset = openai_sampling_params(ChatCompletionRequest(**CHAT), 12, defaults)
    assert (unset["temperature"], unset["top_p"], unset["top_k"], unset["min_p"]) == (0.6, 0.95, 20, 0.0)
    nulls = openai_sampling_params(ChatCompletionRequest(**CHAT, temperature=None, top_k=None), 12, defaults)
    assert (nulls["temperature"], nulls["top_k"]) == (0.6, 20)  # a null is unset
    given = openai_sampling_params(ChatCompletionRequest(**CHAT, temperature=1.0, top_k=-1), 12, defaults)
    assert (given["temperature"], given["top_p"], given["top_k"]) == (1.0, 0.95, -1)


OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


@pytest.mark.parametrize("mode", ["model", "openai"])
def test_chat_uses_them_and_completions_keep_openais(qwen3_defaults_dir, mode):
    """SGLang applies the model's defaults to chat only; /v1/completions keeps its fixed 1.0s."""
    from fastapi.testclient import TestClient

    from engine import Engine
    from engine.server.http import create_app

    eng = Engine(model_path=qwen3_defaults_dir, dtype="float32", device="cpu", sampling_defaults=mode)
    try:
        with TestClient(create_app(eng)) as client:
            chat = [client.post("/v1/chat/completions", json={**CHAT, **extra}).json()["choices"][0]["message"]["content"]
                    for extra in ({}, QWEN3 if mode == "model" else OPENAI)]
            assert chat[0] == chat[1], (mode, chat)
            body = {"prompt": "Once", "max_tokens": 12, "seed": 3}
            completion = [client.post("/v1/completions", json={**body, **extra}).json()["choices"][0]["text"]
                          for extra in ({}, OPENAI)]
            assert completion[0] == completion[1], completion
    finally:
        eng.shutdown()
