"""release/resume_memory_occupation on the GPU with torch-memory-saver (engine/runner/memory_saver.py).

Oracles: device memory from torch.cuda.mem_get_info (the engine runs on a thread of this process,
so the difference to before it started is the engine's memory), and greedy tokens of an engine
started on the final weights (float32 tiny model: same kernels, same batch, so the same tokens).
Run with -s for the timings.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("torch_memory_saver")

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 90))]
ALL = ["weights", "kv_cache", "cuda_graph"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from engine.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("saver")
    return (str(build_tiny_model(root / "a", preset="tiny", seed=0)),
            str(build_tiny_model(root / "b", preset="tiny", seed=1)))


def _engine(path: str, **kwargs):
    from engine import Engine

    return Engine(model_path=path, device="cuda", dtype="float32", cuda_graph_max_bs=8, **kwargs)


def _ids(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _settled_used(timeout_s: float = 30.0) -> int:
    """Device memory once nothing else is letting go of any: earlier tests' engine processes (Ray
    actors, core processes) exit asynchronously, and memory they free during the test once counted
    as this engine's."""
    gc.collect()
    torch.cuda.empty_cache()
    last, deadline, steady = _used(), time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _used()
        steady = steady + 1 if now == last else 0
        if steady == 3:  # three seconds unchanged: an exiting process can pause before it lets go
            return now
        last = now
    return last


def _named(path: str) -> list:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return [(n, t.cuda()) for p in safetensors_files(path) for n, t in load_file(p).items()]


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    out = {}
    for key, path in zip("ab", checkpoints):
        eng = _engine(path, max_total_tokens=65536)
        try:
            out[key] = _ids(eng)
        finally:
            eng.shutdown()
    return out


def test_release_frees_the_engine_and_resume_brings_it_back(checkpoints, expected):
    baseline = _settled_used()  # what earlier engines left is not this engine's
    eng = _engine(checkpoints[0], enable_memory_saver=True, max_total_tokens=16_000_000)  # an 8 GB KV pool
    try:
        assert _ids(eng) == expected["a"]
        held = _used()
        engine_bytes = held - baseline
        graphs = eng.local_core.parts.runner.cuda_graph
        replays = graphs.num_replays
        start = time.perf_counter()
        assert eng.release_memory_occupation()[0]
        released = time.perf_counter() - start
        after_release = _used()
        freed = held - after_release  # measured across the release alone: another process exiting meanwhile
        print(f"  engine {engine_bytes / 2**30:.2f} GB, {freed / 2**30:.3f} GB freed by release ({released * 1e3:.0f} ms)")
        assert freed >= 0.90 * engine_bytes
        hog = torch.empty(int(0.8 * engine_bytes), dtype=torch.uint8, device="cuda")  # the trainer's turn
        del hog
        torch.cuda.empty_cache()
        start = time.perf_counter()
        assert eng.resume_memory_occupation(["weights"])[0]
        ok, message = eng.update_weights_from_tensor(_named(checkpoints[1]), weight_version="b")
        assert ok, message
        assert eng.resume_memory_occupation(["kv_cache", "cuda_graph"])[0]
        print(f"  resume + update: {(time.perf_counter() - start) * 1e3:.0f} ms")
        taken_back = _used() - after_release  # against the level just before, for the same reason
        assert abs(taken_back - freed) <= 0.05 * engine_bytes, (taken_back, freed)
        assert _ids(eng) == expected["b"]
        runner = eng.local_core.parts.runner  # the start-up graphs replay: their pool came back in place
        assert runner.cuda_graph is graphs and graphs.num_replays > replays
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_graph_pool_is_freed_and_its_graphs_replay_after_resume(checkpoints, expected):
    eng = _engine(checkpoints[0], enable_memory_saver=True, max_total_tokens=65536)
    try:
        assert _ids(eng) == expected["a"]
        graphs = eng.local_core.parts.runner.cuda_graph
        replays, held = graphs.num_replays, _used()
        start = time.perf_counter()
        assert eng.release_memory_occupation(["cuda_graph"])[0]
        freed = held - _used()
        assert eng.resume_memory_occupation(["cuda_graph"])[0]
        print(f"  graph pool: {freed / 2**20:.1f} MB freed; release + resume {(time.perf_counter() - start) * 1e3:.0f} ms")
        assert freed >= 2 << 20  # at least one of the pool's segments was unmapped
        assert _ids(eng) == expected["a"]
        assert eng.local_core.parts.runner.cuda_graph is graphs and graphs.num_replays > replays
    finally:
        eng.shutdown()


def test_weights_cpu_backup_survives_release_without_an_update(checkpoints, expected):
    eng = _engine(checkpoints[0], enable_memory_saver=True, enable_weights_cpu_backup=True, max_total_tokens=65536)
    try:
        assert _ids(eng) == expected["a"]
        assert eng.release_memory_occupation()[0]
        assert eng.resume_memory_occupation()[0]
        assert _ids(eng) == expected["a"]
    finally:
        eng.shutdown()


def test_100_release_update_resume_cycles_without_growth(checkpoints, expected):
    """The colocated loop: release -> (trainer step) -> resume weights -> push -> resume KV and graphs."""
    eng = _engine(checkpoints[0], enable_memory_saver=True, max_total_tokens=65536)
    pushes = {"a": _named(checkpoints[0]), "b": _named(checkpoints[1])}
    runner = eng.local_core.parts.runner
    try:
        _ids(eng)
        used = []
        start = time.perf_counter()
        for i in range(100):
            assert eng.release_memory_occupation(ALL)[0]
            scratch = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # a trainer step's allocations
            del scratch
            assert eng.resume_memory_occupation(["weights"])[0]
            ok, message = eng.update_weights_from_tensor(pushes["ab"[i % 2]], weight_version=str(i))
            assert ok, message
            assert eng.resume_memory_occupation(["kv_cache", "cuda_graph"])[0]
            if i % 10 == 0:
                assert _ids(eng) == expected["ab"[i % 2]]
            used.append(_used())
        print(f"  100 cycles in {time.perf_counter() - start:.1f} s; used {used[0] / 2**30:.3f} -> {used[-1] / 2**30:.3f} GB")
        assert used[-1] - used[0] <= 0.01 * used[0] + (16 << 20)  # no growth (1%, 16 MB of slack)
        assert _ids(eng) == expected["b"]  # the 100th push (i = 99) is checkpoint b
        graphs = runner.cuda_graph
        replays = graphs.num_replays
        assert replays > 0
        # graphs kept (not released): they replay on weights and KV restored at the same addresses
        assert eng.release_memory_occupation(["weights", "kv_cache"])[0]
        assert eng.resume_memory_occupation(["weights"])[0]
        assert eng.update_weights_from_tensor(pushes["a"])[0]
        assert eng.resume_memory_occupation(["kv_cache"])[0]
        assert _ids(eng) == expected["a"]
        assert runner.cuda_graph is graphs and graphs.num_replays > replays
        eng.check_integrity()
    finally:
        eng.shutdown()
