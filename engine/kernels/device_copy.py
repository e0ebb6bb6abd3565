"""h2d: host tensor -> device without stalling the host.

A copy from pageable host memory makes CUDA wait for all work already queued on the stream
before it starts, so one innocent `torch.tensor(..., device="cuda")` per step serialises the
host with the GPU and defeats overlap scheduling. Pinned memory + non_blocking avoids that; the
pinned snapshot is owned by torch's caching host allocator until the copy has run.
A leaf (torch only), so the runner, sampling and the attention plans share it.
"""

from __future__ import annotations

import torch


def h2d(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
