"""The LoRA Triton path through the engine, under Triton's CPU interpreter on the tiny model in
float32 (lora_backend="triton"; the GPU's default): the torch path's greedy tokens and logprobs for
a batch mixing two rank-8 adapters, a rank-4 one on q/v only and the base; bitwise mixed == alone
in deterministic mode; decode replayed through the CUDA-graph runner (each "graph" re-runs its
captured closure, as in test_cuda_graph_runner_cpu.py) equal to eager; a pool of 2 slots for 3
adapters evicting and still right. Skipped where triton or peft is absent and on CUDA machines
(tests/gpu/test_lora_gpu.py runs the same compiled).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
if importlib.util.find_spec("peft") is None:
    pytest.skip("needs peft (the test extra)", allow_module_level=True)
triton = import_triton_or_skip()

from tests.engine.lora_setup import GREEDY, PROMPTS, make_peft_adapter  # noqa: E402
from tests.engine.test_cuda_graph_runner_cpu import EagerGraphRunner  # noqa: E402

NAMES = ["a", "b", "c", None]


@pytest.fixture(scope="module")
def lora_paths(model_a, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_triton")
    return [f"a={make_peft_adapter(model_a, root / 'a', seed=1)}", f"b={make_peft_adapter(model_a, root / 'b', seed=2)}",
            f"c={make_peft_adapter(model_a, root / 'c', seed=3, rank=4, alpha=8, targets=['q_proj', 'v_proj'])}"]


def _generate(eng, names, max_new_tokens=6):
    prompts = [p for _ in names for p in PROMPTS]
    outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new_tokens},
                        return_logprob=True, lora_path=[n for n in names for _ in PROMPTS])
    return [o["output_ids"] for o in outs], [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def _close(got, want, tol=1e-5):
    assert got[0] == want[0]
    assert max(abs(x - y) for gx, wx in zip(got[1], want[1]) for x, y in zip(gx, wx)) <= tol


def test_triton_path_equals_torch_path_and_graphs_equal_eager(engine_factory, lora_paths):
    torch_eng = engine_factory(lora_paths=lora_paths, lora_backend="torch_native")
    eng = engine_factory(lora_paths=lora_paths, lora_backend="triton", attention_backend="triton")  # graphs need it
    runner = eng.local_core.parts.runner
    assert runner.lora_pool is not None and runner.lora_pool.max_rank == 8  # inferred from --lora-paths
    want = _generate(torch_eng, NAMES)
    assert want[0][:3] != want[0][-3:]  # the adapters change the tokens
    eager = _generate(eng, NAMES)
    _close(eager, want)
    runner.cuda_graph = EagerGraphRunner(runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token,
                                         runner.device, max_bs=16, lora_pool=runner.lora_pool)
    try:
        replayed = _generate(eng, NAMES)
        base_only = _generate(eng, [None])
        assert runner.cuda_graph.num_replays == 2 * 5  # every decode step of both calls replayed
    finally:
        runner.cuda_graph = None
    _close(replayed, eager)
    _close(base_only, (want[0][-3:], want[1][-3:]))
    eng.check_integrity()


def test_mixed_batch_equals_each_alone_bitwise_deterministic(engine_factory, lora_paths):
    eng = engine_factory(lora_paths=lora_paths, lora_backend="triton", enable_deterministic_inference=True)
    mixed = _generate(eng, NAMES, max_new_tokens=4)
    for k, name in enumerate(NAMES):
        alone = _generate(eng, [name], max_new_tokens=4)
        rows = slice(k * len(PROMPTS), (k + 1) * len(PROMPTS))
        assert (mixed[0][rows], mixed[1][rows]) == alone, name


def test_small_pool_evicts_and_stays_right(engine_factory, lora_paths):
    torch_eng = engine_factory(lora_paths=lora_paths, lora_backend="torch_native", max_loras_per_batch=2)
    eng = engine_factory(lora_paths=lora_paths, lora_backend="triton", max_loras_per_batch=2)
    pool = eng.local_core.parts.runner.lora_pool
    assert pool.num_slots == 2
    for names in (["a", "b"], ["c", None], ["a", "b"], ["c"]):
        _close(_generate(eng, names, max_new_tokens=3), _generate(torch_eng, names, max_new_tokens=3))
    assert pool.loads == 5  # a, b; c over a (least recent); a over c (b resident); c over a or b
