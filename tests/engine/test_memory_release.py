"""release/resume_memory_occupation on the CPU (the API and the core's choreography; the GPU
freeing is tests/gpu/test_memory_saver_gpu.py), and MemorySaver's bookkeeping over a stand-in
for torch-memory-saver."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.runner.memory_saver import MemorySaver
from tests.engine.conftest import random_prompts

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_requests_wait_while_released_and_weights_refuse_updates(engine_factory, other_model_dir, caplog):
    eng = engine_factory(enable_memory_saver=True)  # no effect off the GPU, but accepted
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(4, 20), seed=3)
    before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert eng.release_memory_occupation() == (True, "released weights, kv_cache, cuda_graph")
    assert sorted(eng.get_stats().memory_released) == ["cuda_graph", "kv_cache", "weights"]
    ok, message, _ = eng.update_weights_from_disk(other_model_dir)
    assert not ok and "weights are released" in message
    done: list = []
    waiter = threading.Thread(target=lambda: done.append(eng.generate(input_ids=prompts, sampling_params=GREEDY)))
    second = threading.Thread(target=lambda: eng.generate(input_ids=prompts[0], sampling_params=GREEDY))
    with caplog.at_level("WARNING", logger="engine.core.control"):
        waiter.start()
        second.start()  # a second request while released: no second line
        deadline = time.monotonic() + 30
        while eng.get_stats().num_waiting_reqs < 3 and time.monotonic() < deadline:  # both in the core's queue
            time.sleep(0.05)
    assert eng.get_stats().num_waiting_reqs == 3
    assert waiter.is_alive() and second.is_alive() and not done  # queued, not run, while anything is released
    said = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()]
    assert len(said) == 1 and "cuda_graph, kv_cache, weights released" in said[0], said
    assert eng.resume_memory_occupation(["weights"]) == (True, "resumed weights")
    waiter.join(0.3)
    assert waiter.is_alive()  # kv_cache and cuda_graph still released
    eng.resume_memory_occupation(["kv_cache", "cuda_graph"])
    waiter.join(60)
    second.join(60)
    assert not second.is_alive() and [o["output_ids"] for o in done[0]] == before  # weights kept on the CPU: same tokens
    assert sorted(eng.get_stats().memory_released) == []
    eng.check_integrity()


def test_unknown_tags_are_named(engine):
    with pytest.raises(ValueError, match="unknown memory tag 'gpu'; tags are weights, kv_cache, cuda_graph"):
        engine.release_memory_occupation(["gpu"])
    assert list(engine.get_stats().memory_released) == []


class _FakeSaver:
    """Records what MemorySaver asks of torch-memory-saver."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def region(self, tag: str, enable_cpu_backup: bool):
        import contextlib

        self.calls.append(("region", tag, enable_cpu_backup))
        return contextlib.nullcontext()

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))


def _saver(backup: bool) -> tuple[MemorySaver, _FakeSaver]:
    saver = MemorySaver(False, torch.device("cpu"), weights_cpu_backup=backup)
    fake = _FakeSaver()
    saver.enabled, saver._tms = True, fake
    return saver, fake


def test_memory_saver_tags_are_per_engine_and_paused_once():
    saver, fake = _saver(backup=True)
    other, _ = _saver(backup=False)
    with saver.region("weights"), saver.region("kv_cache"):
        pass
    suffix = saver._suffix
    assert suffix != other._suffix
    assert fake.calls == [("region", "weights" + suffix, True), ("region", "kv_cache" + suffix, False)]
    with pytest.raises(ValueError, match="no memory region for tag 'cuda_graph'"):
        saver.region("cuda_graph")
    fake.calls.clear()
    for tag in ("kv_cache", "kv_cache", "cuda_graph", "weights"):
        saver.pause(tag)
    assert saver.paused == {"kv_cache", "cuda_graph", "weights"}
    saver.resume("weights")
    saver.resume("weights")
    # no graphs were captured (no graph pool): "cuda_graph" has no region to unmap
    assert fake.calls == [("pause", "kv_cache" + suffix), ("pause", "weights" + suffix), ("resume", "weights" + suffix)]
    assert saver.paused == {"kv_cache", "cuda_graph"}
    saver.resume_all()  # what the runner's finalizer does: nothing is freed while unmapped
    assert saver.paused == set() and fake.calls[-1] == ("resume", "kv_cache" + suffix)
    saver._graph_pool = object()  # graphs captured into the region (MemorySaver.graph_pool, GPU only)
    saver.pause("cuda_graph")
    saver.resume("cuda_graph")
    assert fake.calls[-2:] == [("pause", "cuda_graph" + suffix), ("resume", "cuda_graph" + suffix)]


def test_memory_saver_off_the_gpu_allocates_plainly():
    saver = MemorySaver(True, torch.device("cpu"))
    assert not saver.enabled
    with saver.region("weights"):
        t = torch.ones(3)
    saver.pause("weights")
    assert torch.equal(t, torch.ones(3)) and saver.paused == {"weights"}


def test_http_routes_take_sglang_bodies(engine):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(engine)) as client:
        reply = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert reply.status_code == 200 and reply.json() == {"success": True, "message": "released kv_cache"}
        assert list(engine.get_stats().memory_released) == ["kv_cache"]
        reply = client.post("/release_memory_occupation", json={"tags": ["gpu"]})
        assert reply.status_code == 400 and "unknown memory tag 'gpu'" in reply.json()["message"]
        assert client.post("/resume_memory_occupation").json()["message"] == "resumed weights, kv_cache, cuda_graph"
        assert client.get("/release_memory_occupation").json()["message"] == "released weights, kv_cache, cuda_graph"
        assert client.post("/resume_memory_occupation", json={"tags": []}).status_code == 200  # [] = every tag
        assert list(engine.get_stats().memory_released) == []
        out = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY}).json()
        assert len(out["output_ids"]) == 6


class _LosingSaver(_FakeSaver):
    """Pausing loses the region's contents, as unmapped GPU memory does: weights and buffers are
    zeroed, the KV pool filled with NaN."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner

    def pause(self, tag: str) -> None:
        super().pause(tag)
        with torch.no_grad():
            if tag.startswith("weights"):
                for t in [*self.runner.model.parameters(), *self.runner.model.buffers()]:
                    t.zero_()
            if tag.startswith("kv_cache"):
                for t in [*self.runner.kv_pool.k_buffer, *self.runner.kv_pool.v_buffer]:
                    t.fill_(float("nan"))


def test_runner_restores_buffers_and_a_push_restores_weights(engine_factory, other_model_dir, other_engine):
    """The colocated flow over a saver that really loses memory: release -> resume weights ->
    push -> resume KV gives the pushed weights' tokens (buffers such as rotary inv_freq are kept
    by the runner, since no weight update rewrites them)."""
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    eng = engine_factory()
    runner = eng.local_core.parts.runner
    saver = MemorySaver(False, torch.device("cpu"))
    saver.enabled, saver._tms = True, _LosingSaver(runner)
    runner.memory_saver = saver
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(4, 20), seed=4)
    inv_freq = [b.clone() for b in runner.model.buffers()]
    assert inv_freq and all(b.any() for b in inv_freq)
    assert eng.release_memory_occupation()[0]
    assert all(not b.any() for b in runner.model.buffers())  # lost while released
    assert eng.resume_memory_occupation(["weights"])[0]
    assert all(torch.equal(a, b) for a, b in zip(inv_freq, runner.model.buffers()))
    pushed = [item for path in safetensors_files(other_model_dir) for item in load_file(path).items()]
    assert eng.update_weights_from_tensor(pushed, weight_version="pushed")[0]
    assert eng.resume_memory_occupation(["kv_cache", "cuda_graph"])[0]
    suffix = saver._suffix
    assert saver._tms.calls == [("pause", "weights" + suffix), ("pause", "kv_cache" + suffix),
                                ("resume", "weights" + suffix), ("resume", "kv_cache" + suffix)]
    ids = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert ids == [o["output_ids"] for o in other_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    eng.check_integrity()
