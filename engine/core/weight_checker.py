"""WeightChecker: SGLang's /weights_checker, which Miles' --check-weight-update-equal drives.

The check proves that a weight sync rewrote every tensor: `snapshot` keeps a host copy of every
parameter and persistent buffer, `reset_tensors` overwrites them on the device with random
values, and after the trainer's sync `compare` demands each equal its snapshot again. Non-
persistent buffers (rotary caches) are derived, never synced, so they are left alone.
`checksum` hashes each tensor (16 hex digits of sha256, as SGLang replies).

Runs on the core between steps, so it sees the weights the next step uses. The core refuses a
reset while requests hold KV and drops the prefix cache after one (engine/core/weight_reads.py):
nothing computed with the old weights is reused with the random ones, or after the sync. The
snapshot is a host copy of the whole model (its size in host memory) until the next snapshot.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Optional

import torch
from torch import nn

from engine.core.weight_queries import tensor_bytes

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")


class WeightChecker:
    def __init__(self) -> None:
        self._snapshot: Optional[dict[str, torch.Tensor]] = None

    def run(self, model: nn.Module, action: str, skip: Iterable[str] = (),
            allow_quant_error: bool = False) -> dict:
        """{"success": bool, "message": str} (+ "checksums" for checksum); ValueError for a bad
        action or a compare without a snapshot."""
        skipped = set(skip or ())
        if action == "snapshot":
            self._snapshot = {name: t.detach().to("cpu", copy=True) for name, t in synced_tensors(model)}
            return {"success": True, "message": f"snapshot of {len(self._snapshot)} tensors taken"}
        if action == "reset_tensors":
            return self._reset(model, skipped)
        if action == "compare":
            return self._compare(model, skipped, allow_quant_error)
        if action == "checksum":
            sums = {name: _digest(t) for name, t in synced_tensors(model) if name not in skipped}
            return {"success": True, "message": f"checksums of {len(sums)} tensors", "checksums": sums}
        raise ValueError(f"unknown weights_checker action {action!r}; expected one of {list(ACTIONS)}")

    @torch.no_grad()
    def _reset(self, model: nn.Module, skipped: set[str]) -> dict:
        """Random values drawn in place on each tensor's device and dtype (no host-size noise;
        CUDA graphs keep reading the same addresses)."""
        generators: dict[torch.device, torch.Generator] = {}
        count = 0
        for name, tensor in synced_tensors(model):
            if name in skipped:
                continue
            gen = generators.setdefault(tensor.device, torch.Generator(device=tensor.device).manual_seed(0))
            if tensor.is_floating_point():
                tensor.normal_(generator=gen)
            else:
                tensor.random_(0, 2, generator=gen)
            count += 1
        return {"success": True, "message": f"{count} tensors reset to random values"}

    def _compare(self, model: nn.Module, skipped: set[str], allow_quant_error: bool) -> dict:
        if self._snapshot is None:
            raise ValueError("weights_checker compare needs a snapshot first: POST {\"action\": \"snapshot\"}")
        differing, compared = [], 0
        for name, tensor in synced_tensors(model):
            want = self._snapshot.get(name)
            if name in skipped or want is None:
                continue
            compared += 1
            got = tensor.detach().cpu()
            same = torch.equal(got, want) if not allow_quant_error or not got.is_floating_point() else \
                torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)
            if not same:
                differing.append(name)
        if differing:
            shown = ", ".join(differing[:8]) + (f" and {len(differing) - 8} more" if len(differing) > 8 else "")
            return {"success": False, "message": f"{len(differing)} tensors differ from the snapshot: {shown}"}
        return {"success": True, "message": f"all {compared} compared tensors equal their snapshot"}


def synced_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers by name (what a weight sync writes)."""
    out = list(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()[:16]
