"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases per `qkv_bias`), the
sparse MoE block with its shared expert (engine/models/moe.py); `norm_topk_prob` usually off."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import LayerOptions
from engine.models.moe import MoEDecoder
from engine.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(MoEDecoder, Qwen2ForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)
