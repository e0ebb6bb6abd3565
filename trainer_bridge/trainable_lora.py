"""TrainableLoRA: the trainer's LoRA adapter, whose delta is the engine's own code.

Its parameters are PEFT's tensors, one lora_A [r, in] and lora_B [out, r] per HF target module
(q_proj ... down_proj of every decoder layer), named as PEFT saves them
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and initialised as PEFT does
(A kaiming-uniform, B zeros: version 0 is the base model). Each forward builds, from the live
parameters, the engine's LoRAAdapter (engine/lora/adapter.py: the same stacking of q/k/v and
gate/up, checks and scaling) and a LoRABatch putting every token on it, which the model's linears
call through their `lora` seam: the delta is the same function the engine runs, on tensors laid
out by the same code (engine/lora/lora_layout.py), so in deterministic mode trainer logprobs
equal the engine's bit for bit. torch.cat / split keep it differentiable; the base weights are
frozen by the caller.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter
from engine.lora.lora_batch import LoRABatch
from engine.lora.lora_config import LoRALimits, expand_targets
from engine.lora.lora_targets import lora_targets
from engine.lora.peft_format import PEFT_PREFIX, peft_config_dict, save_peft_adapter

ADAPTER_NAME = "policy"  # the name the engines serve the trained adapter under


class TrainableLoRA(nn.Module):
    def __init__(self, model: nn.Module, rank: int, alpha: float, target_modules: Sequence[str],
                 base_model_name_or_path: Optional[str] = None) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.rank, self.alpha = rank, float(alpha)
        self.target_modules = tuple(expand_targets(list(target_modules)))
        self.base_model_name_or_path = base_model_name_or_path
        self.names: list[str] = []  # PEFT names, in parameter order
        self.weights = nn.ParameterList()
        param = next(model.parameters())
        for hf_module, out_rows, in_features in _target_shapes(model, self.target_modules):
            a = torch.empty(rank, in_features, dtype=param.dtype, device=param.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's default init of lora_A
            b = torch.zeros(out_rows, rank, dtype=param.dtype, device=param.device)
            for kind, tensor in (("A", a), ("B", b)):
                self.names.append(f"{PEFT_PREFIX}{hf_module}.lora_{kind}.weight")
                self.weights.append(nn.Parameter(tensor))
        if not self.names:
            raise ValueError(f"the model has no linear among LoRA targets {', '.join(self.target_modules)}")
        self._model_ref = [model]  # not a submodule: its parameters are not the adapter's

    def config_dict(self) -> dict[str, Any]:
        """PEFT's adapter_config.json."""
        return peft_config_dict(self.rank, self.alpha, self.target_modules, self.base_model_name_or_path)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(PEFT name, tensor) of every adapter weight, detached: what a push sends."""
        return [(name, p.detach()) for name, p in zip(self.names, self.weights)]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.weights)

    def lora_batch(self, num_tokens: int, device: torch.device, deterministic: bool = True) -> LoRABatch:
        """Every one of the pass's tokens on this adapter, built from the live parameters."""
        adapter = LoRAAdapter.from_tensors(ADAPTER_NAME, self.config_dict(), zip(self.names, self.weights),
                                           self._model_ref[0], LoRALimits())
        rows = torch.arange(num_tokens, dtype=torch.int64, device=device)
        return LoRABatch(torch.zeros_like(rows), [adapter], [rows], deterministic)

    def save_pretrained(self, out_dir: str) -> Path:
        """PEFT's on-disk format: adapter_config.json + adapter_model.safetensors."""
        return save_peft_adapter(out_dir, self.config_dict(), self.named_tensors())


def _target_shapes(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(HF module name, its output rows, in_features) of every linear the adapter covers, one per
    stacked shard (q/k/v of qkv_proj, gate/up of gate_up_proj), in model order."""
    return [(t.hf_module, t.out_rows, t.in_features) for t in lora_targets(model).by_hf.values() if t.leaf in targets]
