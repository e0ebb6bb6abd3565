"""Determinism tooling: the `tandem determinism` harness, request recording and `tandem replay`.

Nothing here is imported by the engine except `recorder` (when --record-path is set); the
in-process paths never import fastapi, pydantic or httpx.
"""
