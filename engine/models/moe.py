"""The sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE): router, stacked experts, combine,
and Qwen2-MoE's shared expert (a dense MLP gated by sigmoid(shared_expert_gate(x)), added).

Experts are stored stacked per layer, as the fused kernel reads them: `experts.gate_up_proj`
[E, 2I, H] (gate rows 0..I, up rows I..2I) and `experts.down_proj` [E, H, I]; HF's per-expert
tensors are shards (expert, part) of them (engine/models/hf_names.py). On CUDA the experts run in
the Triton fused-MoE kernel (engine/kernels/fused_moe.py; with a gradient too, so the trainer's
forward has the engine's bits); on the CPU in the kernel module's `fused_moe_reference`, the torch
formulation of the same sums.

Routing: logits = gate(x); softmax over experts in float32; top-k; divided by their sum when
`norm_topk_prob`. Every step works row by row (the deterministic mode's batch-invariant linear
for the gate), so a token's route never depends on the rest of the batch. With a route buffer
on the KV pool (--enable-return-routed-experts), each token's top-k ids are stored at its KV slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from engine.kernels.fused_moe import fused_moe_reference
from engine.models.decoder import MLP, LayerOptions, MLPFactory, dense_mlp
from engine.models.hf_names import DENSE_STACKING, EXPERT_STACKING
from engine.models.layers import Linear

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class ExpertWeights(nn.Module):
    """One stacked expert tensor `weight` [E, sum(parts), cols]; shard ids (expert, part), each
    a block of rows of one expert (the loading contract of engine/models/hf_names.py)."""

    def __init__(self, num_experts: int, parts: dict[str, int], cols: int) -> None:
        super().__init__()
        self.num_experts, self.parts = num_experts, dict(parts)
        self.weight = nn.Parameter(torch.empty(num_experts, sum(parts.values()), cols))
        self._rows, start = {}, 0
        for part, size in self.parts.items():
            self._rows[part] = slice(start, start + size)
            start += size

    @property
    def shard_ids(self) -> list[tuple[int, str]]:
        return [(e, part) for e in range(self.num_experts) for part in self.parts]

    def shard_slice(self, shard_id: tuple[int, str]) -> tuple[int, slice]:
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert}: the layer has experts 0..{self.num_experts - 1}")
        return expert, self._rows[part]


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = ExpertWeights(num_experts, {"gate": intermediate_size, "up": intermediate_size},
                                          hidden_size)
        self.down_proj = ExpertWeights(num_experts, {"down": hidden_size}, intermediate_size)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (float32 weights [T, K], int32 expert ids [T, K]). replay: given
    ids [T, K] (a rollout's routes, R3) used instead of the top-k, weighted by their probabilities."""
    probs = torch.softmax(logits.float(), dim=-1)
    if replay is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = replay.to(device=probs.device, dtype=torch.int64)
        weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / _sum_in_order(weights)
    return weights, ids.to(torch.int32)


def _sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, 1], summed k = 0..K-1 (one order for every row and batch size)."""
    total = x[:, :1]
    for k in range(1, x.shape[1]):
        total = total + x[:, k:k + 1]
    return total


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """HF's rule: experts on every `decoder_sparse_step`-th layer outside `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_id + 1) % step == 0)


def sparse_or_dense_mlp(config: Any, layer_id: int, opts: LayerOptions) -> nn.Module:
    """The MLPFactory of the MoE decoders: SparseMoE on sparse layers, a dense MLP elsewhere."""
    if is_sparse_layer(config, layer_id):
        return SparseMoE(config, layer_id, opts)
    return dense_mlp(config, layer_id, opts)


class MoEDecoder:
    """Mixin of the MoE model classes: stacked experts in the HF-name map, the MoE layers, one rank."""
    hf_stacking = EXPERT_STACKING + DENSE_STACKING

    def __init__(self, config: Any, deterministic: bool = False, tp: Optional[Any] = None) -> None:
        if tp is not None:
            raise ValueError("tensor parallelism (tp_size > 1) is not supported for MoE models yet")
        super().__init__(config, deterministic=deterministic)  # type: ignore[call-arg]

    @classmethod
    def mlp_factory(cls, config: Any, opts: LayerOptions) -> MLPFactory:
        return sparse_or_dense_mlp


class SparseMoE(nn.Module):
    """Router `gate` + stacked `experts`; HF names mlp.gate.weight, mlp.experts.{e}.*_proj.weight
    (+ mlp.shared_expert.*, mlp.shared_expert_gate.weight with `shared_expert_intermediate_size`)."""

    def __init__(self, config: Any, layer_id: int, opts: LayerOptions) -> None:
        super().__init__()
        deterministic = opts.deterministic
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu'; got {config.hidden_act!r}")
        self.layer_id = layer_id
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}); got {self.top_k}")
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.deterministic = deterministic
        self.gate = Linear(config.hidden_size, self.num_experts, False, deterministic)
        self.experts = Experts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            self.shared_expert = MLP(config, opts, intermediate_size=shared)
            self.shared_expert_gate = Linear(config.hidden_size, 1, False, deterministic)
        self.has_shared_expert = bool(shared)

    def borrowed_parameters(self) -> list[nn.Parameter]:
        """Parameters of submodules this forward reads itself (their forwards never run): what a
        ZeRO-3 trainer must gather for it (trainer_bridge/deepspeed.py)."""
        return [self.experts.gate_up_proj.weight, self.experts.down_proj.weight]

    def forward(self, x: torch.Tensor, forward_batch: Optional["ForwardBatch"] = None) -> torch.Tensor:
        replay = getattr(forward_batch, "replay_routes", None)  # the trainer's R3: [T, layers, top_k]
        weights, ids = route(self.gate(x), self.top_k, self.renormalize,
                             None if replay is None else replay[:, self.layer_id])
        if forward_batch is not None:
            _record_routes(forward_batch, self.layer_id, ids)
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        if x.is_cuda:  # the trainer too: fused_moe's backward is torch's, its forward the engine's bits
            from engine.kernels.fused_moe import fused_moe

            out = fused_moe(x, w13, w2, weights, ids, self.deterministic)
        else:
            out = fused_moe_reference(x, w13, w2, weights, ids, self.deterministic)
        if self.has_shared_expert:
            gate = self.shared_expert_gate(x)
            # 1 / (1 + exp(-g)): elementwise with the same bits on every path (F.sigmoid's vector
            # body and tail may round differently, engine/kernels/batch_invariant/ops.py)
            gate = 1.0 / (1.0 + torch.exp(-gate)) if self.deterministic else torch.sigmoid(gate)
            out = out + gate * self.shared_expert(x)
        return out


def _record_routes(forward_batch: Any, layer_id: int, ids: torch.Tensor) -> None:
    """Store each token's expert ids: at its KV slot when the engine's pool keeps routes (a plain
    indexed write: CUDA graphs replay it with the batch's slots); by row into the trainer's
    `route_sink` [T, layers, top_k] when its forward asks for them."""
    sink = getattr(forward_batch, "route_sink", None)
    if sink is not None:
        sink[:, layer_id] = ids.to(sink.device)
        return
    routes = getattr(getattr(forward_batch, "kv_pool", None), "routed_experts", None)
    if routes is not None:
        routes[forward_batch.out_cache_loc, layer_id] = ids.to(routes.device)
