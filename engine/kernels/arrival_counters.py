"""Arrival counters: how a kernel's last program to finish a unit of work is found.

Some kernels split one result over several programs and let the last to arrive finish it (the
batch-invariant matmul's split-K sum, decode attention's split merge, the small-M gemv's add +
norm): each program stores its part, then bumps an int32 counter with an acq_rel atomic; the one
that sees count - 1 reads the others' parts and writes the result, then sets the counter back
to 0. So a buffer of counters is zero before and after every launch, and one buffer per (device,
stream) serves every such kernel: launches on a stream run one after another (a PDL launch
touches nothing before its predecessor has completed, engine/kernels/pdl.py), and a CUDA graph
replays from the zeros an eager step leaves.
"""

from __future__ import annotations

import torch

SLOTS = 1 << 16
_BUFFERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, needed: int = 1) -> torch.Tensor:
    """The zeroed int32 counters of `device`'s current stream; `needed` of them are used."""
    if needed > SLOTS:
        raise ValueError(f"{needed} arrival counters wanted, {SLOTS} exist")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return _BUFFERS[key]
