"""build_trainer: the recipe's trainer (torch AdamW here, or DeepSpeed ZeRO on GPUs) on its Policy.

With lora_rank > 0 the Policy's base is frozen and a PEFT adapter is what trains.
The Policy matches the engines' numerics (same checkpoint, dtype, device kind, attention backend
and distribution), so in deterministic mode its logprobs equal the rollout logprobs bit for bit;
in normal mode its linears run on cuBLAS, as the engines' do.
"""

from __future__ import annotations

from typing import Optional

import torch

from tandem.rl.model_source import ModelSource
from recipes.recipe import Recipe
from trainer_bridge.losses import LossConfig
from trainer_bridge.trainer import Trainer


def loss_config(recipe: Recipe) -> LossConfig:
    return LossConfig(recipe.clip_low, recipe.clip_high, recipe.tis_cap, recipe.kl_coef, recipe.aggregation)


def policy_temperature(recipe: Recipe) -> Optional[float]:
    """None: the original distribution, which the engine reports at temperature 1."""
    return None if recipe.temperature == 1.0 else recipe.temperature


def build_trainer(recipe: Recipe, source: ModelSource) -> Trainer:
    dtype = getattr(torch, recipe.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, ...); got {recipe.dtype!r}")
    backend = recipe.engine_args.get("attention_backend")
    if recipe.trainer == "deepspeed":
        from trainer_bridge.deepspeed import DeepSpeedTrainer

        trainer: Trainer = DeepSpeedTrainer.from_pretrained(
            source.path, loss_config(recipe), zero_stage=recipe.zero_stage, dtype=dtype, device=recipe.device,
            load_format=source.load_format, micro_batch_size=recipe.micro_batch_size,
            temperature=policy_temperature(recipe), max_grad_norm=recipe.max_grad_norm, attention_backend=backend,
            batch_invariant=recipe.deterministic)
    else:
        trainer = _torch_trainer(recipe, source, dtype, backend)
    trainer.replay_routes = recipe.routed_experts == "replay"
    return trainer


def _torch_trainer(recipe: Recipe, source: ModelSource, dtype: torch.dtype, backend: Optional[str]) -> Trainer:
    from trainer_bridge.policy import Policy
    from trainer_bridge.trainer import TorchTrainer

    policy = Policy.from_pretrained(source.path, dtype, recipe.device, source.load_format, attention_backend=backend,
                                    batch_invariant=recipe.deterministic)
    if recipe.lora_rank:  # before the optimizer: it holds the adapter's parameters only
        policy.add_lora(recipe.lora_rank, recipe.lora_alpha, recipe.lora_targets, source.path)
    return TorchTrainer(policy, loss_config(recipe), recipe.micro_batch_size, policy_temperature(recipe),
                        max_grad_norm=recipe.max_grad_norm)
