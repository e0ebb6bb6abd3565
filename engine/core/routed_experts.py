"""A finished request's routed experts, as SGLang sends them: meta_info["routed_experts"] is the
base64 of little-endian int32 [tokens, layers, top_k], tokens = prompt + output - 1 (every token
that went through the model; the last sampled one never does), layers = every hidden layer (-1 on
dense ones).

The MoE layers store each token's ids at its KV slot (engine/models/moe.py), so tokens whose KV
came from the radix cache still have the routes computed when that KV was written, under the same
weights (a weight update flushes the cache). Read before the request's row is released.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def routed_experts_b64(routes: Any, req_to_token: Any, req: Any) -> str:
    """routes: the pool's [slots, layers, top_k] int32; req_to_token: the slot table (host)."""
    n = max(min(req.seq_len - 1, req.kv_committed_len), 0)
    slots = req_to_token[req.req_pool_idx, :n].to(routes.device)
    ids = routes[slots].cpu().numpy().astype("<i4", copy=False)
    return base64.b64encode(np.ascontiguousarray(ids).tobytes()).decode("ascii")


def decode_routed_experts(b64: str, num_layers: int, top_k: int) -> np.ndarray:
    """The inverse, for clients and tests: -> int32 [tokens, layers, top_k]."""
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").reshape(-1, num_layers, top_k)
