"""Llama 2/3: biases follow `attention_bias` and `mlp_bias`; llama3 rope scaling lives in layers."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM, LayerOptions


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
