"""train_flops: the matmul FLOPs of one forward + backward over a rollout batch, for a train
phase's TFLOP/s (what `tandem train` reports and scripts/train_step_profile.py sets against the
GPU's bf16 peak).

Counted as training is usually counted (6 FLOPs per weight per token: forward 2, backward 4; 4
when the weights get no gradient, as a LoRA run's frozen base):
every weight but the embedding's over every token; a mixture-of-experts block's experts at
top_k / num_experts of their weights (a token runs top_k of them); the LM head over the rows a
logprob is read from (the response tokens), not every token; causal attention's two matmuls at
12 x layers x heads x head_dim x n^2 / 2 per sequence of n tokens. The embedding lookup, norms
and activations are not matmuls and are left out.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn


def train_flops(model: nn.Module, seq_lens: Sequence[int], logprob_rows: int, weight_grads: bool = True) -> float:
    config = model.config
    per_weight = 6 if weight_grads else 4
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    body = head_weights = 0.0
    experts_share = _experts_share(config)
    for name, param in model.named_parameters():
        count = float(getattr(param, "ds_numel", param.numel()))  # ZeRO-3 keeps a shard: ds_numel is whole
        if "embed_tokens" in name:
            continue
        if "lm_head" in name:
            head_weights += count
        else:
            body += count * (experts_share if ".experts." in name else 1.0)
    if not head_weights:  # tied: the LM head multiplies by the embedding's weights
        head_weights = float(config.vocab_size * config.hidden_size)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head * sum(n * n for n in seq_lens) / 2
    return per_weight * (body * sum(seq_lens) + head_weights * logprob_rows) + attention


def _experts_share(config) -> float:
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0
