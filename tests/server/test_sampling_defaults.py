"""SGLang's --sampling-defaults: the OpenAI routes take the sampling fields a request leaves unset
from the checkpoint's generation_config.json ("model", the default) or from OpenAI ("openai").

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


@pytest.mark.parametrize("mode,expected", [("model", QWEN3), ("openai", {"temperature": 1.0, "top_p": 1.0, "top_k": -1})])
def test_chat_and_completions_use_them(qwen3_defaults_dir, mode, expected):
    from fastapi.testclient import TestClient

    from engine import Engine
    from engine.server.http import create_app

    eng = Engine(model_path=qwen3_defaults_dir, dtype="float32", device="cpu", sampling_defaults=mode)
    try:
        with TestClient(create_app(eng)) as client:
            for route, body in (("/v1/chat/completions", CHAT),
                                ("/v1/completions", {"prompt": "Once", "max_tokens": 12, "seed": 3})):
                unset = client.post(route, json=body).json()
                spelled = client.post(route, json={**body, **expected}).json()
                key = "message" if "messages" in body else "text"
                text = [c[key] if key == "text" else c[key]["content"] for c in (unset["choices"][0], spelled["choices"][0])]
                assert unset["usage"]["completion_tokens"] > 0
                assert text[0] == text[1], (route, mode, text)
    finally:
        eng.shutdown()
