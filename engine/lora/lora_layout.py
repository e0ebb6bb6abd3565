"""LoRALayout: an adapter's tensors copied into engine memory at once, kept as views of few buffers.

A push hands over hundreds of small tensors (504 at Qwen3-8B: 36 layers x 7 linears x A/B) in a
buffer the sender overwrites afterwards, so the engine must copy them. One copy per tensor (a
kernel launch each on the GPU) plus a torch.cat per stacked A was most of a push's build time.
Here each lora_A goes into one buffer per in_features, a stacked module's A matrices next to each
other (its [shards * r, in] is one slice), and each lora_B into one [sum of rows, r] buffer: one
torch.cat per buffer (then one conversion to the engine's dtype and device, when they differ),
split into the views the adapter keeps. cat and split are differentiable with one backward node
each, so the trainer builds its adapter from its parameters through this same code
(trainer_bridge/trainable_lora.py) and its deltas equal the engine's bit for bit. Each view
starts 64-byte aligned, as a tensor allocated alone does: kernels see the alignment they saw.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

ALIGN_BYTES = 64


class _Stack:
    """2-D tensors of `cols` columns stacked by rows into one buffer; each run of them one view."""

    def __init__(self, cols: int, itemsize: int) -> None:
        self.cols = cols
        self.row_step = ALIGN_BYTES // math.gcd(cols * itemsize, ALIGN_BYTES)  # rows between aligned starts
        self.tensors: list[torch.Tensor] = []
        self.pads: list[tuple[int, int]] = []  # (index into tensors, rows of zeros to put before it)
        self.sizes: list[int] = []  # rows of each part the buffer splits into (runs and paddings)
        self.rows = 0

    def add(self, run: Sequence[torch.Tensor], run_rows: int) -> int:
        """-> the index of the run's view among build()'s parts."""
        pad = -self.rows % self.row_step
        if pad:
            self.pads.append((len(self.tensors), pad))
            self.sizes.append(pad)
        self.tensors += run
        self.sizes.append(run_rows)
        self.rows += pad + run_rows
        return len(self.sizes) - 1

    def build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        pieces = self.tensors
        for at, rows in reversed(self.pads):
            src = pieces[0]
            pieces = pieces[:at] + [torch.zeros(rows, self.cols, dtype=src.dtype, device=src.device)] + pieces[at:]
        try:
            buffer = torch.cat(pieces)  # new memory: never the sender's
        except RuntimeError:  # on several devices: each to the engine's first
            buffer = torch.cat([t.to(device) for t in pieces])
        return buffer.to(device, dtype).split(self.sizes)


def lay_out(modules: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device, dtype: torch.dtype
            ) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """modules: per engine module, its shards' (lora_A [r, in], lora_B [rows, r]) in stacking order.
    -> per module (its stacked lora_A [shards * r, in], each shard's lora_B): views of new buffers
    on `device` in `dtype`."""
    r = next(iter(modules.values()))[0][0].shape[0]
    b_stack, a_stacks = _Stack(r, dtype.itemsize), {}  # a_stacks: in_features -> its stack
    where = {}
    for name, shards in modules.items():
        in_features = shards[0][0].shape[1]
        a_stack = a_stacks.get(in_features)
        if a_stack is None:
            a_stack = a_stacks[in_features] = _Stack(in_features, dtype.itemsize)
        a_run = a_stack.add([a for a, _ in shards], len(shards) * r)
        where[name] = (a_stack, a_run, [b_stack.add((b,), b.shape[0]) for _, b in shards])
    parts = {id(stack): stack.build(device, dtype) for stack in (*a_stacks.values(), b_stack)}
    b_parts = parts[id(b_stack)]
    return {name: (parts[id(a_stack)][a], [b_parts[i] for i in bs]) for name, (a_stack, a, bs) in where.items()}
