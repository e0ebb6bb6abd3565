"""Qwen2 / Qwen2.5: bias on q/k/v, none on o_proj, no q/k norm."""

from __future__ import annotations

from typing import Any

from engine.models.decoder import DecoderForCausalLM, LayerOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        return LayerOptions(qkv_bias=True, o_bias=False)
