"""The sampler's compiled noise kernel is built at start-up, so a rollout's first sampled step
does not stall for the seconds torch.compile takes. Run with -s to see the timings."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_first_sampled_requests_do_not_compile(tmp_path):
    from engine import Engine
    from engine.testing.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tiny", preset="tiny"))
    eng = Engine(model_path=path, device="cuda", cuda_graph_max_bs=8, max_total_tokens=8192)
    try:
        assert eng.local_core.parts.runner.sampler._compiled is not None, "not compiled at start-up"
        params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
        for bs in (1, 3):  # compile specialises batch 1; 3 takes the dynamic-shape kernel
            start = time.perf_counter()
            outs = eng.generate(input_ids=[[5, 6, 7, 8]] * bs, sampling_params=params)
            took = time.perf_counter() - start
            print(f"  first sampled bs {bs}: {took * 1e3:.0f} ms")
            assert all(len(o["output_ids"]) == 4 for o in outs)
            assert took < 1.0, f"first sampled request at bs {bs} took {took:.1f} s: compiled late?"
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()
