"""save_hf_checkpoint: the trained policy as an HF checkpoint that transformers and tandem load.

The Policy's parameters carry engine names with stacked `qkv_proj` / `gate_up_proj`; the engine's
HF-name map (engine/models/hf_names.py) splits them back into the checkpoint's q/k/v and gate/up
tensors and drops a tied lm_head. Config, generation config and tokenizer files are copied from
the source checkpoint, so the result is the source's format with new weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from engine.models.hf_names import HFNameMap

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def hf_named_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Engine-named full tensors of `model` (an engine DecoderForCausalLM) -> HF-named tensors."""
    return dict(HFNameMap(model).hf_tensors(named))


def save_hf_checkpoint(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], source_dir: str,
                       out_dir: str) -> Path:
    """Write model.safetensors (+ the source's config and tokenizer files) into out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in hf_named_tensors(model, named).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in CONFIG_FILES:
        if (Path(source_dir) / name).exists():
            shutil.copy(Path(source_dir) / name, out / name)
    return out
