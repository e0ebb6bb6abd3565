"""The LoRA pool (dense path in normal mode, grouped Triton kernels) on the GPU, through the engine: tiny model in float32, three PEFT
adapters (two rank 8 on every linear, one rank 4 on q/v only: below the pool's rank, some shards
empty) and the base, mixed in one batch.

  * the pool path, dense or grouped (CUDA graphs and eager), gives the torch path's greedy tokens, logprobs within
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


@pytest.mark.parametrize("backend", ["triton", "grouped"])  # triton (CUDA's default): dense in normal mode
def test_pool_path_equals_torch_path_graphs_and_eager(model_a, lora_paths, backend):
    torch_path = run(model_a, [NAMES], lora_paths=lora_paths, lora_backend="torch_native", disable_cuda_graph=True)[0]
    assert torch_path[0][:3] != torch_path[0][-3:]  # the adapters change the tokens
    graphs = run(model_a, [NAMES], check=_graphs_replayed, lora_paths=lora_paths, lora_backend=backend)[0]
    eager = run(model_a, [NAMES], lora_paths=lora_paths, lora_backend=backend, disable_cuda_graph=True)[0]
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


def _graph_ms(fn, iters: int = 50) -> float:
    """Mean ms of fn replayed as a CUDA graph (as decode runs it)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()
@pytest.mark.parametrize("num_adapters", [1, 8])
def test_kernels_at_the_8b_shape_bf16(num_adapters):
    """One Llama-8B layer's qkv, gate_up and down at decode bs 256, rank 16, bf16: the Triton path
    within bf16 rounding of the torch path, base rows bitwise untouched; in deterministic mode a
    token's bits the same alone; the LoRA kernels' time in a graph beside the base linears'."""
    from engine.lora.lora_batch import LoRABatch
    from engine.lora.lora_pool import LoRAPool
    from tests.engine.lora_block import ALL_SHARDS, Block, block_inputs, make_adapter, run_block

    torch.manual_seed(0)
    cuda, T = torch.device("cuda"), 256
    block = Block(4096, 14336, 32, 8, 128, deterministic=True).to(cuda, torch.bfloat16)
    adapters = {i: make_adapter(block, f"a{i}", 16, ALL_SHARDS, i, std=0.1) for i in range(1, num_adapters + 1)}
    pool = LoRAPool(block, 8, 16, cuda, torch.bfloat16)
    lora_ids = [None if k % 16 == 0 else 1 + k % num_adapters for k in range(T)]  # 1 in 16 rows the base's
    x = block_inputs(block, T, 0)
    batch = pool.prepare(lora_ids, [1] * T, adapters, True)
    got, base = run_block(block, batch, x), run_block(block, None, x)
    want = run_block(block, LoRABatch.build(lora_ids, [1] * T, adapters, cuda, True), x)
    is_base = torch.tensor([i is None for i in lora_ids], device=cuda)
    for name in got:
        delta = (want[name] - base[name]).float()[~is_base]
        assert delta.norm() > 0.1 * base[name].float()[~is_base].norm()  # the deltas matter
        assert ((got[name] - want[name]).float().norm() / delta.norm()).item() < 2e-2, name
        assert torch.equal(got[name][is_base], base[name][is_base]), name
    rows = [k for k, i in enumerate(lora_ids) if i in (None, 1)][:37]  # adapter 1 and base rows, alone
    alone = run_block(block, pool.prepare([lora_ids[k] for k in rows], [1] * len(rows), adapters, True),
                      {name: v[rows] for name, v in x.items()})
    for name in got:
        assert torch.equal(alone[name], got[name][rows]), name

    def lora_pass():
        batch.begin_pass()
        run_block(block, batch, x)

    base_ms, lora_ms = _graph_ms(lambda: run_block(block, None, x)), _graph_ms(lora_pass)
    print(f"  {num_adapters} adapter(s), bs {T}: base linears {base_ms * 1e3:.0f} us, "
          f"with LoRA {lora_ms * 1e3:.0f} us (+{(lora_ms - base_ms) * 1e3:.0f} us per layer's 3 linears)")
    assert lora_ms < 3 * base_ms


@torch.inference_mode()
@pytest.mark.parametrize("num_adapters", [1, 8])
def test_normal_mode_dense_and_grouped_at_the_8b_shape_bf16(num_adapters):
    """Normal mode at decode bs 256 and a 2048-token prefill, rank 16, bf16: the pool's dense path
    and its grouped kernels both within bf16 rounding of the torch path, base rows bitwise
    untouched; their times in a graph beside the base linears' (the pool's default is the faster)."""
    from engine.lora.lora_batch import LoRABatch
    from engine.lora.lora_pool import LoRAPool
    from tests.engine.lora_block import ALL_SHARDS, Block, block_inputs, make_adapter, run_block

    torch.manual_seed(0)
    cuda = torch.device("cuda")
    block = Block(4096, 14336, 32, 8, 128).to(cuda, torch.bfloat16)
    adapters = {i: make_adapter(block, f"a{i}", 16, ALL_SHARDS, i, std=0.1) for i in range(1, num_adapters + 1)}
    for T in (256, 2048):
        lora_ids = [None if k % 16 == 0 else 1 + k % num_adapters for k in range(T)]
        x = block_inputs(block, T, 0)
        base = run_block(block, None, x)
        want = run_block(block, LoRABatch.build(lora_ids, [1] * T, adapters, cuda, False), x)
        is_base = torch.tensor([i is None for i in lora_ids], device=cuda)
        times = {"base": _graph_ms(lambda: run_block(block, None, x))}
        for dense in (True, False):
            pool = LoRAPool(block, 8, 16, cuda, torch.bfloat16, dense=dense)
            batch = pool.prepare(lora_ids, [1] * T, adapters, False)
            assert batch.dense == dense
            got = run_block(block, batch, x)
            for name in got:
                delta = (want[name] - base[name]).float()[~is_base]
                assert ((got[name] - want[name]).float().norm() / delta.norm()).item() < 2e-2, (dense, name)
                assert torch.equal(got[name][is_base], base[name][is_base]), (dense, name)

            def lora_pass(batch=batch, x=x):
                batch.begin_pass()
                run_block(block, batch, x)

            times["dense" if dense else "grouped"] = _graph_ms(lora_pass)
        print(f"  normal mode, {num_adapters} adapter(s), {T} tokens: base linears {times['base'] * 1e3:.0f} us; "
              f"+LoRA dense +{(times['dense'] - times['base']) * 1e3:.0f} us, "
              f"grouped +{(times['grouped'] - times['base']) * 1e3:.0f} us (per layer's 3 linears)")
