"""The LoRA Triton path compiled on the GPU, through the engine: tiny model in float32, three PEFT
adapters (two rank 8 on every linear, one rank 4 on q/v only: below the pool's rank, some shards
empty) and the base, mixed in one batch.

  * the Triton path (CUDA graphs and eager) gives the torch path's greedy tokens, logprobs within
    float32 tolerance; decode really replays graphs while adapters are in the batch;
  * deterministic mode: the mixed batch equals each adapter run alone, and graphs equal eager,
    bitwise; the base model's outputs are those of an engine without LoRA, bitwise;
  * a pool of 2 slots for 3 adapters evicts (least recently used) and stays right.
Run with -s to see the timings.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
pytest.importorskip("peft")

from tests.engine.lora_setup import GREEDY, PROMPTS, make_peft_adapter  # noqa: E402

NAMES = ["a", "b", "c", None]
BASE = {"device": "cuda", "dtype": "float32", "attention_backend": "triton", "max_total_tokens": 16384,
        "cuda_graph_max_bs": 16}
MAX_NEW = 12


@pytest.fixture(scope="module")
def lora_paths(model_a, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    return [f"a={make_peft_adapter(model_a, root / 'a', seed=1)}", f"b={make_peft_adapter(model_a, root / 'b', seed=2)}",
            f"c={make_peft_adapter(model_a, root / 'c', seed=3, rank=4, alpha=8, targets=['q_proj', 'v_proj'])}"]


def run(model_path: str, batches: list[list], check=None, **kwargs) -> list[tuple[list, list]]:
    """One engine, per batch of adapter names (None: the base): (output ids, logprobs) per row,
    each name given all PROMPTS. check(runner) runs before shutdown."""
    from engine import Engine

    eng = Engine(model_path=model_path, **{**BASE, **kwargs})
    try:
        start = time.perf_counter()
        results = []
        for names in batches:
            outs = eng.generate(input_ids=[p for _ in names for p in PROMPTS],
                                sampling_params={**GREEDY, "max_new_tokens": MAX_NEW}, return_logprob=True,
                                lora_path=[n for n in names for _ in PROMPTS] if kwargs.get("lora_paths") else None)
            results.append(([o["output_ids"] for o in outs],
                            [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]))
        print(f"  {sorted(kwargs)}: {time.perf_counter() - start:.2f} s")
        if check is not None:
            check(eng.local_core.parts.runner)
        return results
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def assert_close(got, want, tol: float) -> None:
    assert got[0] == want[0]
    assert max(abs(x - y) for gx, wx in zip(got[1], want[1]) for x, y in zip(gx, wx)) <= tol


def _graphs_replayed(runner) -> None:
    assert runner.lora_pool is not None and runner.cuda_graph is not None
    assert runner.cuda_graph.lora_pool is runner.lora_pool
    assert runner.cuda_graph.num_replays >= MAX_NEW - 1


def test_triton_path_equals_torch_path_graphs_and_eager(model_a, lora_paths):
    torch_path = run(model_a, [NAMES], lora_paths=lora_paths, lora_backend="torch_native", disable_cuda_graph=True)[0]
    assert torch_path[0][:3] != torch_path[0][-3:]  # the adapters change the tokens
    graphs = run(model_a, [NAMES], check=_graphs_replayed, lora_paths=lora_paths)[0]  # triton: CUDA's default
    eager = run(model_a, [NAMES], lora_paths=lora_paths, disable_cuda_graph=True)[0]
    assert_close(eager, torch_path, 1e-4)
    assert_close(graphs, torch_path, 1e-4)
    assert_close(graphs, eager, 1e-4)


def test_deterministic_mixed_equals_alone_and_graphs_equal_eager_bitwise(model_a, lora_paths):
    det = {"lora_paths": lora_paths, "enable_deterministic_inference": True}
    results = run(model_a, [NAMES] + [[n] for n in NAMES], check=_graphs_replayed, **det)
    mixed, alone = results[0], results[1:]
    for k, name in enumerate(NAMES):
        rows = slice(k * len(PROMPTS), (k + 1) * len(PROMPTS))
        assert (mixed[0][rows], mixed[1][rows]) == alone[k], name
    assert run(model_a, [NAMES], disable_cuda_graph=True, **det)[0] == mixed
    no_lora = run(model_a, [[None]], enable_deterministic_inference=True)[0]
    assert alone[-1] == no_lora  # loading adapters leaves the base model's outputs as they were


def test_small_pool_evicts_and_stays_right(model_a, lora_paths):
    batches = [["a", "b"], ["c", None], ["a", "b"], ["c"]]

    def five_loads(runner) -> None:
        assert runner.lora_pool.num_slots == 2
        assert runner.lora_pool.loads == 5  # a, b; c over a; a over c; c over a or b

    got = run(model_a, batches, check=five_loads, lora_paths=lora_paths, max_loras_per_batch=2)
    want = run(model_a, batches, lora_paths=lora_paths, max_loras_per_batch=2, lora_backend="torch_native",
               disable_cuda_graph=True)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-4)
