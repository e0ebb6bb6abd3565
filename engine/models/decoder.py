"""The decoder-only transformer shared by Llama, Qwen2 and Qwen3.

The three differ only in LayerOptions (biases, per-head q/k norm). Parameter names mirror HF
except the stacked `qkv_proj` and `gate_up_proj` (mapped in engine/models/hf_names.py);
`load_weights` is the one writer of parameters (the disk loader and weight sync both go through it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import nn

from engine.models.parallel_layers import (MergedGateUpParallel, ParallelLMHead, QKVParallelLinear,
                                                RowParallelLinear, TPSharded, VocabParallelEmbedding)
from engine.models.parallel_state import check_tp_size, kv_heads_per_rank
from engine.models.layers import (
    Linear,
    MergedGateUp,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    TorchOps,
    embedding_weight,
    apply_rotary,
    fused_kernel,
)
from engine.models.hf_names import DENSE_STACKING, HFNameMap, Stacking, WeightKey
from engine.models.weight_cast import CastCheck, WeightsPartlyWritten

if TYPE_CHECKING:
    from engine.models.parallel_state import TPGroup
    from engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LayerOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    deterministic: bool = False  # batch-invariant kernels (engine.kernels.batch_invariant)
    tp: Optional["TPGroup"] = None  # tensor parallelism (engine/runner/tp_driver.py); None: one rank, plain layers


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    autograd_ops: Optional[TorchOps] = None  # a trainer's q/k norm + rope (see layers.use_autograd_ops)

    def __init__(self, config: Any, layer_id: int, opts: LayerOptions) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.head_dim = head_dim_of(config)
        self.scaling = self.head_dim**-0.5
        hidden = config.hidden_size
        det = opts.deterministic
        if opts.tp is not None:  # this rank's heads (engine/models/parallel_layers.py)
            self._init_tensor_parallel(config, opts)
            return
        self.qkv_proj = QKVLinear(hidden, self.num_heads, self.num_kv_heads, self.head_dim, opts.qkv_bias, det)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, opts.o_bias, det)
        self._init_qk_norm(config, opts)

    def _init_qk_norm(self, config: Any, opts: LayerOptions) -> None:
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, opts.deterministic)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, opts.deterministic)
        self.qk_norm = opts.qk_norm

    def _init_tensor_parallel(self, config: Any, opts: LayerOptions) -> None:
        tp, det, hidden = opts.tp, opts.deterministic, config.hidden_size
        check_tp_size(tp.size, self.num_heads, self.num_kv_heads)
        self.qkv_proj = QKVParallelLinear(hidden, self.num_heads, self.num_kv_heads, self.head_dim, opts.qkv_bias,
                                          det, tp)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, hidden, opts.o_bias, det, tp)
        self.num_heads, self.num_kv_heads = self.num_heads // tp.size, kv_heads_per_rank(self.num_kv_heads, tp.size)
        self._init_qk_norm(config, opts)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], forward_batch: "ForwardBatch",
                residual: Optional[torch.Tensor] = None, norm: Optional[RMSNorm] = None) -> Any:
        """The block's output; with a norm, (norm(output + residual), the sum), o_proj's epilogue
        fused where it can be. One entry (called as a module) so module hooks fire: ZeRO-3 gathers
        the q/k norm weights registered on this module in its pre-forward hook."""
        out, lora = self._attend(x, cos_sin, forward_batch)
        if norm is None:
            return self.o_proj(out, lora)
        return self.o_proj.forward_add_norm(out, residual, norm, lora)

    def _attend(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                forward_batch: "ForwardBatch") -> tuple[torch.Tensor, Any]:
        """-> (the attention output [tokens, heads * head_dim], before o_proj; the batch's LoRA)."""
        lora = getattr(forward_batch, "lora", None)  # a trainer's pass may bring its own batch type
        q, k, v = self.qkv_proj(x, lora)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
        fused = fused_kernel("qk_norm_rope", q) if self.autograd_ops is None else None
        stored: dict = {}  # {"kv_stored": True}: the fused kernel wrote K/V into the pool
        if self.autograd_ops is not None:
            q, k = self.autograd_ops.qk_norm_rope(q, k, *cos_sin, norm)
        elif fused is not None and (not self.qk_norm or self.q_norm.weight.dtype == q.dtype):
            # one launch for norm + rope of q and k, in place in the qkv output (same bits), and
            # the new k and v into their KV-pool slots where the backend lets it
            slots = self._kv_slots(forward_batch)
            q, k = fused.qk_norm_rope(q, k, *cos_sin, *norm, kv_cache=None if slots is None else (v, *slots))
            stored = {} if slots is None else {"kv_stored": True}
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = forward_batch.attn_backend.forward(q, k, v, self.layer_id, self.scaling, forward_batch, **stored)
        return out.reshape(-1, self.num_heads * self.head_dim), lora

    def _kv_slots(self, forward_batch: "ForwardBatch") -> Optional[tuple]:
        """The backend's KV-pool slots for this layer's new K/V, where it lets the layer write them."""
        backend = forward_batch.attn_backend
        return backend.kv_store_slots(self.layer_id, forward_batch) if hasattr(backend, "kv_store_slots") else None


class MLP(nn.Module):
    def __init__(self, config: Any, opts: LayerOptions, intermediate_size: Optional[int] = None) -> None:
        """intermediate_size: the config's unless given (an MoE block's shared expert)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu'; got {config.hidden_act!r}")
        det, tp = opts.deterministic, opts.tp
        inter = intermediate_size or config.intermediate_size
        if tp is not None:  # this rank's slice of the intermediate size
            self.gate_up_proj = MergedGateUpParallel(config.hidden_size, inter, opts.mlp_bias, det, tp)
            self.down_proj = RowParallelLinear(inter, config.hidden_size, opts.mlp_bias, det, tp)
        else:
            self.gate_up_proj = MergedGateUp(config.hidden_size, inter, opts.mlp_bias, det)
            self.down_proj = Linear(inter, config.hidden_size, opts.mlp_bias, det)
        self.act_fn = SiluAndMul(det)

    def forward(self, x: torch.Tensor, forward_batch: Optional["ForwardBatch"] = None,
                residual: Optional[torch.Tensor] = None, norm: Optional[RMSNorm] = None) -> Any:
        """The block's output; with a norm, (norm(output + residual), the sum), the activation and
        the epilogue fused into down_proj where they can be (Linear.forward_add_norm)."""
        lora = getattr(forward_batch, "lora", None)
        if norm is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x, lora)), lora)
        return self.down_proj.forward_add_norm(self.gate_up_proj(x, lora), residual, norm, lora, act=self.act_fn)


# (config, layer id, options) -> the layer's feed-forward block, called as mlp(hidden, forward_batch)
MLPFactory = Callable[[Any, int, LayerOptions], nn.Module]


def dense_mlp(config: Any, layer_id: int, opts: LayerOptions) -> nn.Module:
    return MLP(config, opts)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, opts: LayerOptions, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, opts)
        self.mlp = make_mlp(config, layer_id, opts)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, opts.deterministic)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, opts.deterministic)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                forward_batch: "ForwardBatch", next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: this layer's input, already normed by its input_layernorm; residual: the stream
        it was normed from. -> (next_norm(out + residual), out + residual): the next layer's input
        and residual, or with the model's final norm the last hidden state. Each residual add and
        norm runs with the linear before it (Linear.forward_add_norm)."""
        hidden, residual = self.self_attn(hidden, cos_sin, forward_batch, residual, self.post_attention_layernorm)
        if isinstance(self.mlp, MLP):
            return self.mlp(hidden, forward_batch, residual, next_norm)
        return next_norm(self.mlp(hidden, forward_batch), residual)  # an MoE block: its own kernels


class DecoderModel(nn.Module):
    def __init__(self, config: Any, opts: LayerOptions, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        if opts.tp is not None:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, opts.tp)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=embedding_weight(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, opts, make_mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, opts.deterministic)
        # one rope for all layers: cos/sin are computed once per forward
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if not len(self.layers):
            return self.norm(hidden)
        cos_sin = self.rotary_emb(positions)
        residual, hidden = hidden, self.layers[0].input_layernorm(hidden)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            hidden, residual = layer(hidden, residual, cos_sin, forward_batch, next_norm)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the model classes; subclasses only choose `layer_options(config)`."""

    # how HF tensors stack into parameters (engine/models/hf_names.py)
    hf_stacking: tuple[Stacking, ...] = DENSE_STACKING

    def __init__(self, config: Any, deterministic: bool = False, tp: Optional["TPGroup"] = None) -> None:
        """deterministic: batch-invariant kernels everywhere (--enable-deterministic-inference);
        attention is the backend's choice, made when the backend is created. tp: this rank's
        tensor-parallel group (tp_size > 1): parameters hold this rank's shards, loading cuts
        them out of the full HF tensors."""
        super().__init__()
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("sliding-window attention layers are not supported")
        self.config = config
        self.deterministic = deterministic
        opts = dataclasses.replace(self.layer_options(config), deterministic=deterministic, tp=tp)
        self.model = DecoderModel(config, opts, self.mlp_factory(config, opts))
        if tp is not None:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, deterministic, tp)
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, deterministic)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()
        self._name_lora_targets()

    def _name_lora_targets(self) -> None:
        """The attention and dense MLP linears learn their module names: how a LoRA adapter finds
        them (an MoE block's experts, router and shared expert take no adapter)."""
        for i, layer in enumerate(self.model.layers):
            for part_name in ("self_attn", "mlp"):
                part = getattr(layer, part_name)
                if isinstance(part, (Attention, MLP)):
                    for name, module in part.named_children():
                        if isinstance(module, Linear):
                            module.lora_name = f"model.layers.{i}.{part_name}.{name}"

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_non_checkpoint_state(self) -> None:
        """Restore what no checkpoint holds after `to_empty` (meta-device construction):
        rope frequencies, and the lm_head/embedding tie that `to_empty` breaks."""
        self.model.rotary_emb.reset_inv_freq()
        self.tie_weights()

    @classmethod
    def layer_options(cls, config: Any) -> LayerOptions:
        raise NotImplementedError

    @classmethod
    def mlp_factory(cls, config: Any, opts: LayerOptions) -> MLPFactory:
        """Each layer's feed-forward block; dense everywhere unless a subclass says (MoE)."""
        return dense_mlp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """-> final-normed hidden states [T, hidden]."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]; with `out`, written into it in its
        dtype (float32: the cast is that copy; the model's dtype: the LM head's GEMM writes it)."""
        if out is not None:
            return self.lm_head.forward_into(hidden, out)
        return self.lm_head(hidden).float()

    # ---- weight loading: HF names come from the one map (engine/models/hf_names.py) ----

    @property
    def hf_names(self) -> HFNameMap:
        return HFNameMap(self)

    def check_weights(self, named_specs: Iterable[tuple]) -> set[WeightKey]:
        """(name, shape) or (name, shape, dtype of a host tensor) items: raise ValueError naming
        the first whose name, shape or dtype does not fit; returns the keys they would write
        (see `missing_weights`), without writing any."""
        params, names = dict(self.named_parameters()), self.hf_names
        casts = CastCheck()
        covered: set[WeightKey] = set()
        for name, shape, *dtype in named_specs:
            target = self._resolve(name, tuple(shape), params, names)
            if target is not None:
                if dtype:
                    casts.check_dtype(name, dtype[0], params[target[0]])
                covered |= names.keys_covered(*target)
        return covered

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[WeightKey]:
        """Copy HF-named tensors into parameters (dtype cast). Every tensor's name, shape and
        dtype (castable to its parameter's) is checked before any parameter is written, so a bad
        payload leaves the model untouched; a copy that still fails raises WeightsPartlyWritten.
        Returns the (parameter, shard id) keys written; see `missing_weights`."""
        params, names = dict(self.named_parameters()), self.hf_names
        casts = CastCheck()
        plan = []
        for name, tensor in weights:
            if not torch.is_floating_point(tensor):
                raise ValueError(f"weight {name!r} has non-floating dtype {tensor.dtype}")
            target = self._resolve(name, tuple(tensor.shape), params, names)
            if target is not None:
                casts.check(name, tensor, params[target[0]])
                plan.append((target, self._rank_part(*target, tensor)))
        loaded: set[WeightKey] = set()
        with torch.no_grad():
            for i, ((param_name, shard_id), tensor) in enumerate(plan):
                try:
                    names.view(param_name, shard_id, params[param_name].data).copy_(tensor)
                except Exception as exc:
                    raise WeightsPartlyWritten(f"copying into {param_name} failed after {i} of {len(plan)} "
                                               f"tensors were written: {type(exc).__name__}: {exc}") from exc
                loaded |= names.keys_covered(param_name, shard_id)
        return loaded

    def missing_weights(self, loaded: set[WeightKey]) -> list[str]:
        """HF names of the checkpoint tensors not in `loaded`."""
        return self.hf_names.missing(loaded)

    def _resolve(self, name: str, shape: tuple[int, ...], params: dict[str, nn.Parameter],
                 names: HFNameMap) -> Optional[WeightKey]:
        """HF name -> (parameter name, shard id), None for tensors to skip; checks the shape."""
        if names.skipped(name):
            return None
        param_name, shard_id = names.engine_key(name)
        if param_name not in params:
            raise ValueError(f"unknown weight {name!r}: no such parameter in {type(self).__name__}")
        sharded = self._tp_sharded(param_name)
        if sharded is not None:  # tensor parallel: the checkpoint holds the full tensor
            expected = sharded.checkpoint_shape(param_name.rsplit(".", 1)[1], shard_id)
        else:
            try:
                expected = tuple(names.view(param_name, shard_id, params[param_name]).shape)
            except KeyError as exc:  # a shard the parameter does not hold, e.g. expert 9 of 8
                raise ValueError(f"unknown weight {name!r}: {exc.args[0]}") from None
        if shape != expected:
            raise ValueError(f"weight {name!r} has shape {list(shape)}, expected {list(expected)}")
        return param_name, shard_id

    def _tp_sharded(self, param_name: str) -> Optional[TPSharded]:
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        return module if isinstance(module, TPSharded) else None

    def _rank_part(self, param_name: str, shard_id: Any, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full checkpoint tensor (the tensor itself without TP)."""
        sharded = self._tp_sharded(param_name)
        if sharded is None:
            return tensor
        return sharded.rank_part(param_name.rsplit(".", 1)[1], shard_id, tensor)
