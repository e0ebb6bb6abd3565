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
        self.pieces: list = []  # tensors, and ints: rows of padding
        self.sizes: list[int] = []  # rows of each part the buffer splits into (runs and paddings)
        self.rows = 0

    def add(self, run: Sequence[torch.Tensor]) -> int:
        """-> the index of the run's view among build()'s parts."""
        pad = -self.rows % self.row_step
        if pad:
            self.pieces.append(pad)
            self.sizes.append(pad)
        run_rows = sum(t.shape[0] for t in run)
        self.pieces.extend(run)
        self.sizes.append(run_rows)
        self.rows += pad + run_rows
        return len(self.sizes) - 1

    def build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        tensors = [p for p in self.pieces if not isinstance(p, int)]
        if len({t.device for t in tensors}) > 1:  # cat needs one device: each goes to the engine's first
            tensors = [t.to(device) for t in tensors]
        src = tensors[0]
        it = iter(tensors)
        pieces = [torch.zeros(p, self.cols, dtype=src.dtype, device=src.device) if isinstance(p, int) else next(it)
                  for p in self.pieces]
        buffer = torch.cat(pieces).to(device, dtype)  # cat's output is new memory: never the sender's
        return buffer.split(self.sizes)


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
        a_stack = a_stacks.setdefault(in_features, _Stack(in_features, dtype.itemsize))
        where[name] = (a_stack, a_stack.add([a for a, _ in shards]), [b_stack.add([b]) for _, b in shards])
    parts = {id(stack): stack.build(device, dtype) for stack in (*a_stacks.values(), b_stack)}
    b_parts = parts[id(b_stack)]
    return {name: (parts[id(a_stack)][a], [b_parts[i] for i in bs]) for name, (a_stack, a, bs) in where.items()}
