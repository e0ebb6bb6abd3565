"""tandem's serving engine. `from engine import Engine` is the in-process API."""

from typing import Any

__all__ = ["Engine", "ServerArgs", "SamplingParams"]


def __getattr__(name: str) -> Any:  # lazy, so `import engine.config` stays light
    if name == "Engine":
        from engine.api.engine import Engine

        return Engine
    if name == "ServerArgs":
        from engine.config import ServerArgs

        return ServerArgs
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
