"""Fixtures of the rollout tests: two tiny checkpoints, in-process oracle engines on each, and
one Ray cluster (started once per session: ~7 s on a 2-core machine) with one engine actor."""

from __future__ import annotations

import pytest

# Every engine here runs the deterministic mode, so the trainer's Policy recomputes the engine's
# rollout logprobs bit for bit and greedy tokens of two engines on one checkpoint agree exactly.
ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "enable_deterministic_inference": True}
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [300, 12, 800, 9, 77]]


@pytest.fixture(scope="session")
def model_a() -> str:
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path())


@pytest.fixture(scope="session")
def model_b() -> str:
    """The tiny model's architecture and tokenizer with other weights (seed 1): an update's source."""
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path(seed=1))


@pytest.fixture(scope="session")
def oracle_a(model_a):
    from engine import Engine

    eng = Engine(model_path=model_a, **ENGINE_KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def oracle_b(model_b):
    from engine import Engine

    eng = Engine(model_path=model_b, **ENGINE_KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from rollout.engine_actor import ensure_ray

    # light for a CI box; no memory monitor: on a shared test machine another job's peak memory
    # would make Ray kill the engine actor mid-test (OutOfMemoryError), which tests nothing of ours
    ensure_ray(num_cpus=2, log_to_driver=False, object_store_memory=256 << 20,
               _system_config={"memory_monitor_refresh_ms": 0})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def colocation(ray_cluster):
    """One bundle (CPU only here; one GPU on a GPU node) that the engine actor and the trainer
    actor share, as a colocated pair would."""
    from rollout.engine_actor import colocation_group

    group = colocation_group(1, gpus_per_bundle=0)
    yield group
    ray_cluster.util.remove_placement_group(group)


@pytest.fixture(scope="session")
def engine_actor(ray_cluster, colocation, model_a):
    """One engine actor on checkpoint A for the session; tests that change its weights put A back."""
    from rollout.engine_actor import start_engine_actors

    (actor,) = start_engine_actors(1, {"model_path": model_a, **ENGINE_KWARGS}, placement_group=colocation)
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


def greedy_ids(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
