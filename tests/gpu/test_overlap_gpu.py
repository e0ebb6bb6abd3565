"""Overlap scheduling on the GPU: lookahead decode steps (launched before the previous step's
tokens are read back) give exactly the tokens and logprobs of the plain loop, with CUDA graphs,
in deterministic mode (so the comparison can be bitwise), including requests that finish early."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")


def run(model_path: str, overlap: bool) -> tuple[list[dict], int]:
    from engine import Engine

    eng = Engine(model_path=model_path, device="cuda", dtype="float32", enable_deterministic_inference=True,
                 disable_overlap_schedule=not overlap, cuda_graph_max_bs=64, max_total_tokens=32768)
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 200))] for _ in range(48)]
        params = [{"max_new_tokens": 8 + i % 40, "temperature": 1.0 if i % 2 else 0.0, "sampling_seed": i,
                   "ignore_eos": i % 3 == 0} for i in range(48)]
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        eng.check_integrity()
        return outs, eng.local_core.stats.num_lookahead_steps
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def test_overlap_matches_plain_loop_bitwise():
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    plain, plain_ahead = run(path, overlap=False)
    over, ahead = run(path, overlap=True)
    print(f"  lookahead steps: {ahead}")
    assert plain_ahead == 0 and ahead > 10
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
    assert [o["meta_info"]["output_token_logprobs"] for o in over] == [o["meta_info"]["output_token_logprobs"] for o in plain]
