"""The tandem command tests run engines over the tiny model: the engine tests' fixtures."""

from tests.engine.conftest import engine, engine_factory, tiny_model_dir  # noqa: F401  (pytest fixtures)
