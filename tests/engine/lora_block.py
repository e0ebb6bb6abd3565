"""A qkv, a gate_up and a down linear with LoRA names, and random adapters for them built directly
(no PEFT): the LoRA kernel tests' model, on the CPU interpreter (test_lora_triton.py) and on the
GPU at the 8B shape (tests/gpu/test_lora_gpu.py). Imports no triton."""

from __future__ import annotations

import torch

from engine.lora.adapter import LoRAAdapter, LoRAModule, LoRAShard
from engine.lora.lora_config import LoRAConfig
from engine.models.layers import Linear, MergedGateUp, QKVLinear

NAMES = ("qkv_proj", "gate_up_proj", "down_proj")
ALL_SHARDS = {"qkv_proj": ["q", "k", "v"], "gate_up_proj": [0, 1], "down_proj": [None]}


class Block(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(hidden, heads, kv_heads, head_dim, False, deterministic)
        self.gate_up_proj = MergedGateUp(hidden, inter, False, deterministic)
        self.down_proj = Linear(inter, hidden, False, deterministic)
        for name in NAMES:
            getattr(self, name).lora_name = name


def make_adapter(block: Block, name: str, rank: int, shards: dict[str, list], seed: int, pinned: bool = False,
                 std: float = 1.0) -> LoRAAdapter:
    """shards: module name -> the shard ids it targets ([None] for a plain linear); on the block's
    device and dtype."""
    param = next(block.parameters())
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for module_name, ids in shards.items():
        module = getattr(block, module_name)
        a_list, parts = [], []
        for k, shard_id in enumerate(ids):
            rows = slice(0, module.out_features) if shard_id is None else module.shard_slice(shard_id)
            a_list.append(torch.randn(rank, module.in_features, generator=g) * std)
            b = (torch.randn(rows.stop - rows.start, rank, generator=g) * std).to(param.device, param.dtype)
            parts.append(LoRAShard(rows, slice(k * rank, (k + 1) * rank), b))
        modules[module_name] = LoRAModule(torch.cat(a_list).to(param.device, param.dtype), parts, 2.0 / rank)
    return LoRAAdapter(name, None, LoRAConfig(rank, 2.0, ("q_proj",)), modules, pinned)


def run_block(block: Block, batch, x: dict) -> dict:
    """Each target linear's output (base + the batch's deltas); q, k, v side by side."""
    outs = {name: getattr(block, name)(x[name], batch) for name in NAMES}
    return {name: torch.cat(out, -1) if isinstance(out, tuple) else out for name, out in outs.items()}


def block_inputs(block: Block, tokens: int, seed: int, std: float = 1.0) -> dict:
    param = next(block.parameters())
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(tokens, getattr(block, name).in_features, generator=g) * std).to(param.device, param.dtype)
            for name in NAMES}

