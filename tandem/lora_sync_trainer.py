"""The trainer side of `tandem bench-sync --lora-rank R`: a LoRA adapter pushed by reference.

LoRATrainer holds a random rank-R adapter of a checkpoint's shapes (PEFT names; the targets of
--lora-target-modules, every dense linear by default) in one flattened bucket, as a trainer with a
contiguous adapter buffer does. `step` redraws it in place (a training step's new adapter), so
every push sends the same buffer: one CUDA IPC handle (shared memory on the CPU), and GPU memory
stays flat. It runs where tandem/sync_trainer.py's trainers run: a spawned process, a Ray actor,
or this process (--transport inprocess: the bucket's tensors are handed over unserialized).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.lora.lora_config import LORA_TARGETS

LOAD_FORMATS = ("flattened_bucket", "direct")


class LoRATrainer:
    def __init__(self, model_path: str, dtype: str, device: str, rank: int,
                 target_modules: Sequence[str] = LORA_TARGETS, seed: int = 0) -> None:
        from engine.lora.peft_format import peft_config_dict
        from engine.testing.random_lora import lora_shapes, lora_tensor_specs
        from weight_sync.bucket import FlattenedBucket

        self.dtype, self.device = getattr(torch, dtype), torch.device(device)
        shapes = lora_shapes(model_path, target_modules or LORA_TARGETS)
        targets = sorted({module.rpartition(".")[2] for module, _, _ in shapes}, key=LORA_TARGETS.index)
        self.config = peft_config_dict(rank, 2.0 * rank, targets, model_path)
        specs = [(name, shape, self.dtype) for name, shape in lora_tensor_specs(shapes, rank)]
        self.bucket = FlattenedBucket.empty(specs, self.device)
        self.step(seed)

    def layout(self) -> dict[str, Any]:
        return {"num_buckets": 1, "total_bytes": self.bucket.flattened_tensor.numel(),
                "num_tensors": len(self.bucket.metadata), "lora_rank": self.config["r"],
                "lora_target_modules": self.config["target_modules"]}

    def step(self, seed: int) -> None:
        """A new adapter in the same buffer."""
        from engine.testing.random_lora import fill_random_lora

        fill_random_lora(self.bucket.unpack(), seed)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def tensors(self, load_format: str) -> Any:
        """The push's tensors: the bucket payload, or (name, view into the bucket) pairs."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
        return self.bucket.to_payload() if load_format == "flattened_bucket" else self.bucket.unpack()

    def payload(self, load_format: str) -> str:
        """The tensors serialized as SGLang's serialized_tensors (base64): references, no copy."""
        from weight_sync.cuda_ipc import serialize

        return serialize(self.tensors(load_format), as_text=True)

    def save(self, out_dir: str) -> str:
        """The current adapter in PEFT's format (the check that the engine serves what was pushed)."""
        from engine.lora.peft_format import save_peft_adapter

        return str(save_peft_adapter(out_dir, self.config, self.bucket.unpack()))

    def ipc_collect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()

