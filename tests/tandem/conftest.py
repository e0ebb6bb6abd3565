"""Fixtures for the commands' tests that run an engine in-process: the tiny model and engines on it
(the determinism harness, the bench's HF names; these tests moved here from tests/engine/ with engine/cli/)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def engine_factory(tiny_model_dir):
    from engine import Engine

    engines = []

    def make(**kwargs):
        eng = Engine(model_path=tiny_model_dir, **{"dtype": "float32", "device": "cpu", **kwargs})
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


@pytest.fixture(scope="session")
def engine(engine_factory):
    return engine_factory()
