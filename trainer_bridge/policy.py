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

MoE models: `rollout_routes` gives the routes the policy's own forward takes (equal to the
engine's meta_info["routed_experts"] in deterministic mode: route agreement 1.0 without replay),
and `rollout_logprobs(..., routed_experts=...)` replays a rollout's routes instead (R3).

`policy.model.named_parameters()` uses engine parameter names (stacked qkv_proj / gate_up_proj),
which the engine's `load_weights` accepts for weight sync.

Normal mode (`batch_invariant=False`): only deterministic mode needs the engine's bits, so the
policy runs as a trainer would: cuBLAS linears, norms / rope / activation with real backwards
(engine.models.layers.use_autograd_ops: Liger Kernel's on CUDA, trainer_bridge/liger_ops.py; the
torch code elsewhere), flash attention forward and backward (VarlenAttention), and the LM head's
logprobs in chunks of rows without the full logits (token_logprobs). The fused kernels' backwards
recompute their torch code, and the engine's attention kernel had a float32 backward: on the H200
the recipe's train step spent most of its host time there (scripts/train_step_profile.py).

LoRA RL: `add_lora` freezes the model and adds a TrainableLoRA (trainer_bridge/trainable_lora.py),
whose delta every forward adds through the linears' `lora` seam with the engine's own LoRA code.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn
from transformers import AutoConfig

from engine.kernels import batch_invariant as bi
from engine.kernels.device_copy import h2d
from engine.models.layers import Linear, use_autograd_ops
from engine.models.loader import load_model
from trainer_bridge.liger_ops import autograd_ops
from trainer_bridge.packed_attention import PackedAttention, PackedBatch, packed_positions
from trainer_bridge.token_logprobs import recomputed_logprobs, token_logprobs
from trainer_bridge.trainable_lora import TrainableLoRA
from trainer_bridge.varlen_attention import VarlenAttention


class Policy(nn.Module):
    """attention_backend / split_size: those of the engine to match; None = the engine's defaults
    (triton with 256-key splits on CUDA, torch with 64 elsewhere), see PackedAttention.
    batch_invariant=False: normal mode (see the module doc); the model's layers switch to torch code."""

    def __init__(self, model: nn.Module, attention_backend: Optional[str] = None,
                 split_size: Optional[int] = None, batch_invariant: bool = True) -> None:
        super().__init__()
        if not getattr(model, "deterministic", False):
            raise ValueError("Policy needs a model built with deterministic=True (batch-invariant kernels)")
        self.model = model
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self.attention = PackedAttention(attention_backend, split_size)
        else:
            use_autograd_ops(model, autograd_ops(next(model.parameters()).device))
            self.attention = VarlenAttention()
        self.lora: Optional[TrainableLoRA] = None

    def add_lora(self, rank: int, alpha: float, target_modules: Sequence[str],
                 base_model_name_or_path: Optional[str] = None) -> TrainableLoRA:
        """Freeze the base model; only the new adapter's parameters train from here on."""
        self.model.requires_grad_(False)
        self.lora = TrainableLoRA(self.model, rank, alpha, target_modules, base_model_name_or_path)
        return self.lora

    @classmethod
    def from_pretrained(cls, model_path: str, dtype: torch.dtype = torch.float32,
                        device: Union[str, torch.device] = "cpu", load_format: str = "auto",
                        attention_backend: Optional[str] = None,
                        split_size: Optional[int] = None, batch_invariant: bool = True) -> "Policy":
        hf_config = AutoConfig.from_pretrained(model_path)
        model = load_model(model_path, hf_config, dtype, device, load_format, deterministic=True)
        model.requires_grad_(True)  # the loader freezes it for serving
        return cls(model, attention_backend, split_size, batch_invariant)

    def forward(self, input_ids: torch.Tensor, seq_lens: Sequence[int], replay_routes: Optional[torch.Tensor] = None,
                route_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Packed ids [T] of whole sequences (lengths seq_lens) -> final hidden states [T, hidden].
        MoE: replay_routes [T, layers, top_k] replaces the routers' choices; route_sink of that
        shape receives them."""
        device = input_ids.device
        positions = h2d(packed_positions(seq_lens), device)  # each token's place in its sequence
        lora = None if self.lora is None else self.lora.lora_batch(len(input_ids), device)
        batch = PackedBatch(list(seq_lens), self.attention, replay_routes=replay_routes, route_sink=route_sink,
                            lora=lora)
        return self.model(input_ids, positions, batch)

    def rollout_routes(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                       ) -> list[torch.Tensor]:
        """MoE: the routes of each rollout's prompt + response - 1 tokens, int32 [n, layers, top_k]
        (-1 on dense layers), in the engine's routed_experts layout."""
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        ids = h2d(torch.tensor([t for s in seqs for t in s], dtype=torch.int64), self._device())
        sink = torch.full((len(ids), *self._routes_shape()), -1, dtype=torch.int32, device=ids.device)
        with torch.no_grad():
            self.forward(ids, [len(s) for s in seqs], route_sink=sink)
        return [rows[:-1] for rows in sink.split([len(s) for s in seqs])]

    def route_agreement(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        routed_experts: Sequence[Union[str, torch.Tensor]]) -> tuple[int, int]:
        """(routes the policy's forward picks as given, routes compared): over every token's sparse
        layers and top-k slots, the rollout's routes (as the engine returned them) vs its own."""
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        given = self._packed_replay(routed_experts, seqs)
        ours = torch.cat([torch.cat([r, given.new_full((1, *r.shape[1:]), -1)])
                          for r in self.rollout_routes(prompts, responses)])
        sparse = ours >= 0  # dense layers and each sequence's unrouted last token hold -1
        return int((ours == given)[sparse].sum()), int(sparse.sum())

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _routes_shape(self) -> tuple[int, int]:
        config = self.model.config
        if not getattr(config, "num_experts_per_tok", None):
            raise ValueError("routes exist for mixture-of-experts models only")
        return config.num_hidden_layers, config.num_experts_per_tok

    def _packed_replay(self, routed_experts: Sequence[Union[str, torch.Tensor]], seqs: list[list[int]]) -> torch.Tensor:
        """Per rollout, the engine's routes (base64 or [n - 1, layers, top_k]) -> packed [T, layers, top_k];
        each sequence's last token (whose output no logprob reads) takes experts 0..top_k-1."""
        from engine.core.routed_experts import decode_routed_experts

        layers, top_k = self._routes_shape()
        if len(routed_experts) != len(seqs):
            raise ValueError(f"{len(seqs)} rollouts but {len(routed_experts)} routed_experts")
        rows = []
        for routes, seq in zip(routed_experts, seqs):
            if isinstance(routes, str):
                routes = torch.from_numpy(decode_routed_experts(routes, layers, top_k).copy())
            if tuple(routes.shape) != (len(seq) - 1, layers, top_k):
                raise ValueError(f"routed_experts of shape {list(routes.shape)} for a rollout of {len(seq)} tokens; "
                                 f"expected {[len(seq) - 1, layers, top_k]}")
            rows += [routes.to(torch.int32), torch.arange(top_k, dtype=torch.int32).expand(1, layers, top_k)]
        return h2d(torch.cat(rows), self._device())

    def rollout_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: Optional[float] = None,
                         routed_experts: Optional[Sequence[Union[str, torch.Tensor]]] = None) -> list[torch.Tensor]:
        """Logprob of each response token given everything before it, one [len(response)] float32
        tensor per rollout. temperature=None: the original distribution (the engine's default
        logprob_distribution); a value: log_softmax(logits / T), which is the engine's "processed"
        distribution when no penalty or top-k/top-p/min-p applies. routed_experts (MoE): each
        rollout's routes as the engine returned them, replayed instead of the routers' top-k (R3)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        device = next(self.model.parameters()).device
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        seq_lens = [len(s) for s in seqs]
        rows, targets, offset = [], [], 0
        for p, r, s in zip(prompts, responses, seqs):
            # the row of token i predicts token i + 1
            rows.extend(range(offset + len(p) - 1, offset + len(s) - 1))
            targets.extend(r)
            offset += len(s)
        # every input built on the host first and queued behind the device's work (h2d): a pageable
        # copy per tensor made the host wait for the previous micro batch's backward each time
        ids, rows, targets = (h2d(torch.tensor(x, dtype=torch.int64), device)
                              for x in ([t for s in seqs for t in s], rows, targets))
        replay = None if routed_experts is None else self._packed_replay(routed_experts, seqs)
        hidden = self.forward(ids, seq_lens, replay_routes=replay)
        hidden = hidden[rows]
        head = self.model.lm_head
        # ZeRO-3 partitions the head's weight (ds_numel) and gathers it only for the head's own forward
        whole_head = type(head) is Linear and head.bias is None and not hasattr(head.weight, "ds_numel")
        if not self.batch_invariant and whole_head:
            picked = token_logprobs(hidden, head.weight, targets, temperature)  # no [rows, vocab] logits kept
        else:
            scale = None if temperature is None else h2d(torch.tensor(temperature, dtype=torch.float32), device)
            picked = recomputed_logprobs(hidden, targets, lambda rows: self._row_logprobs(rows, scale),
                                         recompute=not hasattr(head.weight, "ds_numel"))
        return list(picked.split([len(r) for r in responses]))

    def _row_logprobs(self, hidden: torch.Tensor, temperature: Optional[torch.Tensor]) -> torch.Tensor:
        """[rows, vocab] float32 log_softmax of the head's logits (divided by temperature)."""
        logits = self.model.compute_logits(hidden)
        if temperature is not None:
            logits = logits / temperature
        return bi.log_softmax(logits) if self.batch_invariant else torch.log_softmax(logits, -1)
