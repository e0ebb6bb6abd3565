"""slime's top-p replay on the GPU: the kept sets travel behind an event with the sampled ids
(engine/sampling/nucleus.py: KeptIds), under overlap scheduling and CUDA graphs. Oracle: the same
engine in deterministic mode without overlap (sets bitwise equal), and each token inside its set."""

from __future__ import annotations

import base64
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


def _decode(meta: dict) -> list[list[int]]:
    ids = torch.frombuffer(bytearray(base64.b64decode(meta["top_p_token_ids"])), dtype=torch.int32).tolist()
    offsets = torch.frombuffer(bytearray(base64.b64decode(meta["top_p_token_offsets"])), dtype=torch.int32).tolist()
    assert offsets[0] == 0 and offsets[-1] == len(ids)
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


def run(overlap: bool, head_columns: int, monkeypatch) -> list[dict]:
    from engine import Engine
    from engine.sampling import nucleus
    from engine.testing.tiny_model import tiny_model_path

    monkeypatch.setattr(nucleus, "HEAD_COLUMNS", head_columns)
    eng = Engine(model_path=str(tiny_model_path()), device="cuda", dtype="float32",
                 enable_deterministic_inference=True, disable_overlap_schedule=not overlap,
                 cuda_graph_max_bs=64, max_total_tokens=32768)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 120))] for _ in range(40)]
        params = [{"max_new_tokens": 6 + i % 30, "temperature": [1.0, 0.7, 0.0][i % 3], "top_p": 0.9,
                   "top_k": 50 if i % 4 == 0 else -1, "sampling_seed": i, "ignore_eos": True,
                   "custom_params": {"return_top_p_token_ids": i % 5 != 4}} for i in range(40)]
        return eng.generate(input_ids=prompts, sampling_params=params)
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def test_kept_sets_under_overlap_equal_the_plain_loops(monkeypatch):
    plain = run(False, 1024, monkeypatch)
    for overlap, head in ((True, 1024), (True, 4)):  # 4: most sets wider than the head, read after
        got = run(overlap, head, monkeypatch)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in plain]
        for i, (o, p) in enumerate(zip(got, plain)):
            if i % 5 == 4:
                assert "top_p_token_ids" not in o["meta_info"]
                continue
            sets = _decode(o["meta_info"])
            assert sets == _decode(p["meta_info"]) and len(sets) == len(o["output_ids"])
            assert all(t in s for t, s in zip(o["output_ids"], sets))
            if i % 3 == 2:  # greedy: the token alone
                assert sets == [[t] for t in o["output_ids"]]
