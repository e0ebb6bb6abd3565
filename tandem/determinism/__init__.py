"""Determinism tooling: the `tandem determinism` harness, and `tandem replay`.

Nothing here is imported by the engine (the recorder is engine/api/recorder.py); the
in-process paths never import fastapi, pydantic or httpx.
"""
