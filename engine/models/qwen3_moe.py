"""Qwen3-MoE: Qwen3's attention, a sparse MoE block (engine/models/moe.py) as the feed-forward of
every `decoder_sparse_step`-th layer not in `mlp_only_layers`; the others keep a dense MLP of
`intermediate_size`. Tensor parallelism is not offered for it (experts would need their own split).
"""

from __future__ import annotations

from engine.models.moe import MoEDecoder
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEDecoder, Qwen3ForCausalLM):
    pass
