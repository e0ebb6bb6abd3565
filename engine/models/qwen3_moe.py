"""Qwen3-MoE: Qwen3's attention, a sparse MoE block (engine/models/moe.py) as the feed-forward of
every `decoder_sparse_step`-th layer not in `mlp_only_layers`; the others keep a dense MLP of
`intermediate_size`. Tensor parallelism is not offered for it (experts would need their own split).
"""

from __future__ import annotations

from typing import Any, Optional

from engine.models.decoder import MLPFactory, LayerOptions, dense_mlp
from engine.models.hf_names import DENSE_STACKING, EXPERT_STACKING
from engine.models.moe import SparseMoE
from engine.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """HF's rule: experts on every `decoder_sparse_step`-th layer outside `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    hf_stacking = EXPERT_STACKING + DENSE_STACKING

    def __init__(self, config: Any, deterministic: bool = False, tp: Optional[Any] = None) -> None:
        if tp is not None:
            raise ValueError("tensor parallelism (tp_size > 1) is not supported for MoE models yet")
        super().__init__(config, deterministic=deterministic)

    @classmethod
    def mlp_factory(cls, config: Any, opts: LayerOptions) -> MLPFactory:
        def make_mlp(config: Any, layer_id: int, opts: LayerOptions):
            if is_sparse_layer(config, layer_id):
                return SparseMoE(config, layer_id, opts.deterministic)
            return dense_mlp(config, layer_id, opts)
        return make_mlp
