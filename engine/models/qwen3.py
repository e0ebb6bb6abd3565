"""Qwen3: per-head q/k RMSNorm before rope; attention biases follow `attention_bias` (off)."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM, LayerOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
