"""Routed experts read on the GPU (engine/core/routed_experts.py RouteReader: a gather, a copy into
a reused pinned buffer, base64 on threads). Oracles: the same tensor read on the CPU path, and an
engine on the CPU (float32, deterministic) for a tiny MoE's routes."""

from __future__ import annotations

import pytest
import torch

from engine.core.routed_experts import RouteReader, decode_routed_experts

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_pinned_read_equals_the_cpu_read_and_survives_growth():
    gen = torch.Generator().manual_seed(0)
    reader, cpu_reader = RouteReader(), RouteReader()
    for rows in (1000, 3_000_000, 1000):  # the second needs a larger pinned buffer; the third reuses it
        routes = torch.randint(-1, 128, (rows, 4, 8), dtype=torch.int32, generator=gen)
        slots = [torch.randperm(rows, generator=gen)[:n] for n in (7, rows // 3, 1, rows // 5, 50)]
        got = reader.read(routes.cuda(), slots)
        assert got == cpu_reader.read(routes, slots)
        assert torch.equal(torch.from_numpy(decode_routed_experts(got[1], 4, 8).copy()), routes[slots[1]])


@pytest.fixture(scope="module")
def moe_mixed_model_dir(tmp_path_factory) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "m", preset="tiny-moe-mixed", seed=0))


def test_engine_routes_on_cuda_equal_the_cpu_engine(moe_mixed_model_dir):
    from engine import Engine
    from tests.engine.conftest import random_prompts

    prompts = random_prompts(6, 1000, lengths=(5, 40), seed=3)
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    got = {}
    for device in ("cpu", "cuda"):
        # a bounded pool, as the suite's other engines: by default the KV pool takes most of the card,
        # and on an 80 GB H100 the earlier tests' engines left it too little (2026-12-06)
        with Engine(model_path=moe_mixed_model_dir, dtype="float32", device=device, enable_return_routed_experts=True,
                    enable_deterministic_inference=True, max_total_tokens=16384, cuda_graph_max_bs=16) as eng:
            got[device] = eng.generate(input_ids=prompts, sampling_params=greedy, return_routed_experts=True)
    for c, g in zip(got["cpu"], got["cuda"], strict=True):
        if c["output_ids"] == g["output_ids"]:  # float32 on both: near-ties aside, the same tokens and routes
            assert g["meta_info"]["routed_experts"] == c["meta_info"]["routed_experts"]
    assert sum(c["output_ids"] == g["output_ids"] for c, g in zip(got["cpu"], got["cuda"])) >= 5
