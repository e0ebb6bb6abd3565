"""check_cpu_memory: refuse a CPU run that cannot fit in RAM, before it starts.

A real-shape model on the CPU (`--model qwen3-0.6b`: 0.6 B parameters) needs the trainer's
weights, gradients and AdamW moments (4 copies) plus, per engine, its weights and a KV cache that
is allocated in full at start-up (65,536 tokens unless max_total_tokens says otherwise: 15 GiB for
Qwen3-0.6B in float32). Past the machine's RAM the run thrashes for minutes, then the OOM killer
ends it with no message; this says so up front, with the max_total_tokens that would fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from recipes.recipe import Recipe

GIB = 1 << 30
HEADROOM = 0.8  # of MemAvailable: activations, the tokenizer, Python, the rollout batches


def check_cpu_memory(recipe: Recipe, model_path: str) -> None:
    if recipe.device != "cpu":
        return
    available = available_bytes()
    if available is None:
        return
    dtype = getattr(torch, recipe.dtype)
    params, kv_per_token = _model_sizes(model_path, dtype)
    width = torch.empty((), dtype=dtype).element_size()
    trainer = params * width * (4 + (1 if recipe.kl_coef > 0 else 0))  # + the frozen KL reference
    tokens = _kv_tokens(recipe)
    engine = params * width + tokens * kv_per_token
    need = trainer + recipe.num_engines * engine
    if need <= HEADROOM * available:
        return
    fits = int((HEADROOM * available - trainer - recipe.num_engines * params * width)
               // (recipe.num_engines * kv_per_token)) // 1024 * 1024
    hint = "use "
    if fits >= 1024:
        fewer = "use fewer --num-engines, " if recipe.num_engines > 1 else "use "
        hint = f"set --engine-args '{{\"max_total_tokens\": {fits}}}' (KV cache tokens per engine), {fewer}"
    raise ValueError(f"model {recipe.model!r} on the CPU needs about {need / GIB:.1f} GiB (trainer "
                     f"{trainer / GIB:.1f}: weights, gradients, AdamW moments; {recipe.num_engines} engine(s) x "
                     f"{engine / GIB:.1f}: weights + a KV cache of {tokens} tokens) but {available / GIB:.1f} GiB "
                     f"are free: {hint}a smaller --model (tiny), or a GPU")


def available_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _model_sizes(model_path: str, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, KV bytes per token) of the checkpoint's architecture, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.decoder import head_dim_of
    from engine.runner.memory import kv_bytes_per_token

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return params, kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim_of(config), dtype)


def _kv_tokens(recipe: Recipe) -> int:
    from engine.runner.memory import CPU_DEFAULT_TOTAL_TOKENS

    return int(recipe.engine_args.get("max_total_tokens") or CPU_DEFAULT_TOTAL_TOKENS)
