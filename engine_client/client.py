"""The engine as RL code sees it: `engine.api.protocol.EngineAPI`, in three forms.

RolloutManager, trainer_bridge.sync.push_weights and the colocation choreography take any
EngineAPI: an `Engine` in this process (it satisfies the protocol itself), a `tandem serve` (or
SGLang) server over SGLang's HTTP routes (`HttpClient`), or a Ray engine actor (`RayClient`,
engine_client/engine_actor.py, which forwards every Engine method by name). Method names and
replies are Engine's (SGLang's): generate returns the same dicts, weight updates (success, message).

Tensor payloads by reference: HttpClient and RayClient(tensor_transport="ipc") send
`weight_sync.cuda_ipc.serialize` payloads (CUDA IPC handles on a GPU, shared-memory descriptors
on the CPU), so the sender must keep the tensors alive until the call returns, as in SGLang.
"""

from __future__ import annotations

from typing import Any

from engine.api.protocol import EngineAPI, Reply

__all__ = ["EngineAPI", "HttpClient", "RayClient", "Reply"]


def __getattr__(name: str) -> Any:
    """HttpClient and RayClient live in their own modules (httpx, ray imported there)."""
    if name == "HttpClient":
        from engine_client.http_client import HttpClient

        return HttpClient
    if name == "RayClient":
        from engine_client.ray_client import RayClient

        return RayClient
    raise AttributeError(f"module 'engine_client.client' has no attribute {name!r}")
