"""slime's /pull_weights (disk-delta weight sync) against a served tiny model: a published xor
delta pulled into a local folder, which /update_weights_from_disk then loads; the weight read back
is the published one. Bad requests are 400s naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load_file, save_file

zstandard = pytest.importorskip("zstandard")

from engine.server.http import create_app  # noqa: E402

NAME = "model.norm.weight"


def _publish_delta(src: str, version: int, old: np.ndarray, new: np.ndarray) -> None:
    path = os.path.join(src, f"weight_v{version:06d}")
    os.makedirs(path)
    a, b = old.reshape(-1).view(np.uint8), new.reshape(-1).view(np.uint8)
    delta = np.frombuffer(zstandard.ZstdCompressor().compress((a ^ b).tobytes()), np.uint8)
    save_file({NAME: delta}, os.path.join(path, "model-00001-of-00001.safetensors"),
              metadata={NAME: f"{zlib.adler32(b.tobytes(), 1):08x}"})
    meta = {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": "xor",
            "compression_format": "zstd", "checksum_format": "adler32"}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": meta, "weight_map": {NAME: "model-00001-of-00001.safetensors"}}, f)


def _tensor(ckpt: str, name: str) -> np.ndarray:
    for fname in os.listdir(ckpt):
        if fname.endswith(".safetensors"):
            tensors = load_file(os.path.join(ckpt, fname))
            if name in tensors:
                return tensors[name]
    raise KeyError(name)


def test_pull_then_reload_serves_the_published_weights(engine_factory, tiny_model_dir, tmp_path):
    old = _tensor(tiny_model_dir, NAME)
    new = (old * 2 + 1).astype(old.dtype)
    src, local = str(tmp_path / "published"), str(tmp_path / "local")
    _publish_delta(src, 1, old, new)
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        body = {"local_checkpoint_dir": local, "source_dir": src, "target_version": 1}
        resp = c.post("/pull_weights", json=body)
        assert resp.status_code == 200 and resp.json() == {"success": True, "message": "Success."}
        assert np.array_equal(_tensor(local, NAME), new)
        assert np.array_equal(_tensor(tiny_model_dir, NAME), old)  # the served checkpoint untouched
        resp = c.post("/update_weights_from_disk", json={"model_path": local, "weight_version": "1"})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        served = c.post("/get_weights_by_name", json={"name": NAME, "truncate_size": 100}).json()
        assert np.allclose(np.array(served, dtype=np.float32).reshape(-1)[:new.size], new.astype(np.float32).reshape(-1))
        # a second pull of the same version reads nothing; version 0 starts from the served checkpoint again
        assert c.post("/pull_weights", json=body).json()["success"]
        assert c.post("/pull_weights", json={**body, "target_version": 0}).json()["success"]
        assert np.array_equal(_tensor(local, NAME), old)


@pytest.mark.parametrize("body,status,words", [
    ({"source_dir": "/x", "target_version": 1}, 400, "local_checkpoint_dir"),
    ({"local_checkpoint_dir": "L", "source_dir": "S", "target_version": "1"}, 400, "target_version"),
    ({"local_checkpoint_dir": "L", "source_dir": "S", "target_version": 3}, 400, "weight_v000003 does not exist"),
    ({"local_checkpoint_dir": "L", "source_dir": "S", "target_version": -2}, 400, "non-negative"),
])
def test_bad_pulls_are_400s_and_serving_goes_on(engine_factory, tmp_path, body, status, words):
    body = {k: (str(tmp_path / v) if k.endswith("_dir") else v) for k, v in body.items()}
    eng = engine_factory()
    with TestClient(create_app(eng)) as c:
        resp = c.post("/pull_weights", json=body)
        assert resp.status_code == status and words in resp.text, resp.text
        out = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert out.status_code == 200


def test_pull_weights_takes_the_admin_key(engine_factory, tmp_path):
    eng = engine_factory()
    with TestClient(create_app(eng, api_key="gen", admin_api_key="admin")) as c:
        body = {"local_checkpoint_dir": str(tmp_path / "l"), "source_dir": str(tmp_path / "s"), "target_version": 0}
        assert c.post("/pull_weights", json=body, headers={"Authorization": "Bearer gen"}).status_code == 401
        assert c.post("/pull_weights", json=body, headers={"Authorization": "Bearer admin"}).json()["success"]
