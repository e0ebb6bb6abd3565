"""The tandem command tests run engines over the tiny model: the engine tests' fixtures."""

from tests.engine.conftest import engine, engine_factory, other_model_dir, tiny_model_dir  # noqa: F401  (fixtures)
