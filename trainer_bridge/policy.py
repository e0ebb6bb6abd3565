"""Policy: the trainer's model, bit-compatible with the engine's deterministic mode.

Built from engine.models through the registry and loader with the batch-invariant kernels, and
run as a trainer runs a model: one full-sequence forward over packed (prompt + response)
sequences, attention straight on the computed K/V (no KV pool) through the split-KV attention
of the engine's backend (PackedAttention: the torch function on the CPU, the Triton kernel on
CUDA). Every kernel's per-row bits are independent of the batch and of prefill vs decode, so
`rollout_logprobs` equals, bit for bit, the `output_token_logprobs` an engine started with
`enable_deterministic_inference=True` (same checkpoint, dtype, device kind, attention backend and
split size) returned ("true on-policy", DESIGN section 4, property 5). It stays differentiable:
parameters require grad and nothing runs under inference mode; on CUDA the Triton kernels run
inside autograd.Functions with torch backwards (engine.kernels.batch_invariant.autograd,
PackedAttention).

`policy.model.named_parameters()` uses engine parameter names (stacked qkv_proj / gate_up_proj),
which the engine's `load_weights` accepts for weight sync.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn
from transformers import AutoConfig

from engine.kernels import batch_invariant as bi
from engine.models.loader import load_model
from trainer_bridge.packed_attention import PackedAttention, PackedBatch


class Policy(nn.Module):
    """attention_backend / split_size: those of the engine to match; None = the engine's defaults
    (triton with 256-key splits on CUDA, torch with 64 elsewhere), see PackedAttention."""

    def __init__(self, model: nn.Module, attention_backend: Optional[str] = None,
                 split_size: Optional[int] = None) -> None:
        super().__init__()
        if not getattr(model, "deterministic", False):
            raise ValueError("Policy needs a model built with deterministic=True (batch-invariant kernels)")
        self.model = model
        self.attention = PackedAttention(attention_backend, split_size)

    @classmethod
    def from_pretrained(cls, model_path: str, dtype: torch.dtype = torch.float32,
                        device: Union[str, torch.device] = "cpu", load_format: str = "auto",
                        attention_backend: Optional[str] = None,
                        split_size: Optional[int] = None) -> "Policy":
        hf_config = AutoConfig.from_pretrained(model_path)
        model = load_model(model_path, hf_config, dtype, device, load_format, deterministic=True)
        model.requires_grad_(True)  # the loader freezes it for serving
        return cls(model, attention_backend, split_size)

    def forward(self, input_ids: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """Packed ids [T] of whole sequences (lengths seq_lens) -> final hidden states [T, hidden]."""
        device = input_ids.device
        positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
        return self.model(input_ids, positions, PackedBatch(list(seq_lens), self.attention))

    def rollout_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: Optional[float] = None) -> list[torch.Tensor]:
        """Logprob of each response token given everything before it, one [len(response)] float32
        tensor per rollout. temperature=None: the original distribution (the engine's default
        logprob_distribution); a value: log_softmax(logits / T), which is the engine's "processed"
        distribution when no penalty or top-k/top-p/min-p applies."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        device = next(self.model.parameters()).device
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
        hidden = self.forward(ids, [len(s) for s in seqs])
        rows, targets, offset = [], [], 0
        for p, r, s in zip(prompts, responses, seqs):
            # the row of token i predicts token i + 1
            rows.extend(range(offset + len(p) - 1, offset + len(s) - 1))
            targets.extend(r)
            offset += len(s)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
        if temperature is not None:
            logits = logits / torch.tensor(temperature, dtype=torch.float32, device=device)
        logprobs = bi.log_softmax(logits)
        picked = logprobs.gather(1, torch.tensor(targets, dtype=torch.int64, device=device)[:, None])[:, 0]
        return list(picked.split([len(r) for r in responses]))
