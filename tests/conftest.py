"""Suite-wide pytest hooks: `gpu`-marked tests are skipped on machines without CUDA; Triton's
interpreter computes tl.dot row by row on every CPU (engine/testing/triton_for_tests.py). Session
fixtures of the rollout, client and trainer tests: two tiny checkpoints, in-process oracle engines
on each, and one Ray cluster (started once, when first asked for: ~7 s on 2 cores) with one engine
actor."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rl_setup import ENGINE_KWARGS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    # The interrupt tests run first: they start `tandem train` in a subprocess with Ray's memory
    # monitor on, which kills its engine actor when the node is nearly full, and this process grows
    # by several GB over the suite. The tests that use the session's Ray cluster and engine actor
    # (fixtures below), which hold memory until the session ends, run last. A stable sort keeps the
    # order otherwise (tests/tandem/test_train_failures.py must stay after the Triton kernel tests:
    # running Triton attention without its interpreter there leaves triton with no driver).
    items.sort(key=_run_order)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def _run_order(item: pytest.Item) -> int:
    if Path(str(item.fspath)).name == "test_interrupt.py":
        return 0
    return 2 if "ray_cluster" in getattr(item, "fixturenames", ()) else 1


@pytest.fixture(autouse=True, scope="session")
def _row_invariant_interpreter_dot() -> None:
    from engine.testing.triton_for_tests import row_invariant_interpreter_dot

    row_invariant_interpreter_dot()  # after collection: the Triton test modules set TRITON_INTERPRET


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
    from engine_client.engine_actor import ensure_ray

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
    from engine_client.engine_actor import colocation_group

    group = colocation_group(1, gpus_per_bundle=0)
    yield group
    ray_cluster.util.remove_placement_group(group)


@pytest.fixture(scope="session")
def engine_actor(ray_cluster, colocation, model_a):
    """One engine actor on checkpoint A for the session; tests that change its weights put A back."""
    from engine_client.engine_actor import start_engine_actors

    (actor,) = start_engine_actors(1, {"model_path": model_a, **ENGINE_KWARGS}, placement_group=colocation)
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)
