"""An engine actor and a trainer actor sharing one GPU through Ray (fractional num_gpus): pushes by
CUDA IPC, the colocated step (release -> train -> resume weights -> push -> resume KV) and the
push time of the Qwen3-0.6B shape. Oracles: an engine started on the pushed checkpoint (greedy
tokens), the trainer's Policy (rollout logprobs bit for bit, deterministic mode) and the GPU's
free memory. Run with -s for the measured numbers. Written without a GPU: not yet run on one.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
ray = pytest.importorskip("ray")

ENGINE = {"dtype": "float32", "device": "cuda", "enable_deterministic_inference": True,
          "enable_memory_saver": True, "mem_fraction_static": 0.3}
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 90))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from engine.testing.tiny_model import build_tiny_model

    return (str(build_tiny_model(tmp_path_factory.mktemp("a"), seed=0)),
            str(build_tiny_model(tmp_path_factory.mktemp("b"), seed=1)))


@pytest.fixture(scope="module", autouse=True)
def cluster():
    from engine_client.engine_actor import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _greedy(client) -> list:
    return [o["output_ids"] for o in client.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_actors_share_the_gpu_and_a_cuda_ipc_push_equals_an_engine_on_the_new_checkpoint(checkpoints):
    from engine import Engine
    from engine_client.engine_actor import start_engine_actors
    from engine_client.ray_client import RayClient
    from trainer_bridge.colocate import PushConfig
    from trainer_bridge.trainer_actor import start_trainer_actor

    from engine_client.engine_actor import colocation_group

    a, b = checkpoints
    group = colocation_group(1)  # one GPU for the pair, whatever the node has
    (engine,) = start_engine_actors(1, {"model_path": a, **ENGINE}, num_gpus=0.5, placement_group=group)
    trainer = start_trainer_actor(b, num_gpus=0.5, device="cuda", placement_group=group)
    oracle = Engine(model_path=b, **{**ENGINE, "enable_memory_saver": False, "mem_fraction_static": 0.1})
    try:
        client = RayClient(engine)
        seconds = ray.get(trainer.push_weights.remote([engine], "b", PushConfig(bucket_bytes=64 << 10), "ipc"))
        print(f"\ntiny model push by CUDA IPC across actors: {seconds * 1e3:.1f} ms")
        assert _greedy(client) == _greedy(oracle) and client.get_weight_version() == "b"
    finally:
        oracle.shutdown()
        ray.kill(trainer)
        ray.kill(engine)
        ray.util.remove_placement_group(group)


def test_the_colocated_step_frees_the_engine_memory_and_stays_on_policy(checkpoints):
    from engine_client.engine_actor import start_engine_actors
    from rollout.manager import RolloutManager
    from engine_client.ray_client import RayClient
    from trainer_bridge.colocate import PushConfig
    from trainer_bridge.trainer_actor import start_trainer_actor

    a, _ = checkpoints
    trainer = start_trainer_actor(a, num_gpus=0.5, device="cuda")
    free_before_engine = _free_bytes()
    (engine,) = start_engine_actors(1, {"model_path": a, **ENGINE}, num_gpus=0.5)
    try:
        client = RayClient(engine)
        engine_bytes = free_before_engine - _free_bytes()
        assert client.release_memory_occupation()[0]
        freed = _free_bytes() - (free_before_engine - engine_bytes)
        print(f"\nengine holds {engine_bytes / 2**30:.2f} GiB; release frees {freed / 2**30:.2f} GiB")
        assert freed >= 0.9 * engine_bytes
        assert client.resume_memory_occupation()[0] and client.update_weights_from_disk(a)[0]
        sampled = {**GREEDY, "temperature": 1.0}
        samples = [s for g in RolloutManager([client]).generate(PROMPTS, sampled, n=2) for s in g]
        advantages = [1.0 if s.index == 0 else -1.0 for s in samples]
        metrics, phases = ray.get(trainer.colocated_step.remote([engine], samples, advantages, 1e-3, "step-1",
                                                                PushConfig(), "ipc"))
        print("colocated step phases (s):", {k: round(v, 4) for k, v in phases.items()})
        assert metrics["grad_norm"] > 0
        after = [s for g in RolloutManager([client]).generate(PROMPTS, sampled, n=2) for s in g]
        assert all(set(s.weight_versions) == {"step-1"} for s in after)
        trainer_lps = ray.get(trainer.rollout_logprobs.remote([s.prompt_ids for s in after],
                                                              [s.response_ids for s in after]))
        assert [s.rollout_logprobs for s in after] == trainer_lps
    finally:
        ray.kill(trainer)
        ray.kill(engine)


def test_push_time_of_the_qwen3_0_6b_shape_across_actors(tmp_path):
    """Pause -> 512 MiB buckets by CUDA IPC -> flush + version -> continue, trainer actor to engine
    actor on one GPU; GPU memory stays flat over the pushes."""
    from engine.testing.tiny_model import build_tiny_model
    from engine_client.engine_actor import start_engine_actors
    from engine_client.ray_client import RayClient
    from trainer_bridge.colocate import PushConfig
    from trainer_bridge.trainer_actor import start_trainer_actor

    path = str(build_tiny_model(tmp_path / "shape", preset="qwen3-0.6b"))
    (engine,) = start_engine_actors(1, {"model_path": path, "dtype": "bfloat16", "load_format": "dummy",
                                        "mem_fraction_static": 0.3}, num_gpus=0.5)
    trainer = start_trainer_actor(path, num_gpus=0.5, device="cuda", dtype="bfloat16", load_format="dummy")
    try:
        times, free = [], []
        for step in range(8):
            start = time.perf_counter()
            ray.get(trainer.push_weights.remote([engine], f"v{step}", PushConfig(), "ipc"))
            times.append(time.perf_counter() - start)
            free.append(_free_bytes())
        median = statistics.median(times[1:])  # the first push warms up the IPC path
        print(f"\nqwen3-0.6b shape push across actors: median {median * 1e3:.1f} ms over {len(times) - 1}, "
              f"free GPU memory drift {(free[1] - free[-1]) / 2**20:.1f} MiB")
        client = RayClient(engine)
        assert client.get_weight_version() == "v7" and len(client.generate(input_ids=[5, 6],
                                                                           sampling_params=GREEDY)["output_ids"]) == 16
        assert median < 0.5
        assert free[1] - free[-1] < 0.01 * torch.cuda.mem_get_info()[1]
    finally:
        ray.kill(trainer)
        ray.kill(engine)
