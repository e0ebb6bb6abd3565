"""Building blocks shared by the decoder models: norm, rotary embedding, activation, stacked linears.

Numerics follow HF transformers so HF can serve as the oracle: RMSNorm normalises in float32 and
casts back before the weight multiply; rotary cos/sin are computed in float32 and cast to the
activation dtype before they are applied.

`deterministic=True` (chosen at construction) routes linears, norms and the activation through
engine.kernels.batch_invariant, whose per-row bits do not depend on the batch.

On CUDA the q/k norm + rotary and the activation run fused Triton kernels (engine/kernels/
qk_norm_rope.py, silu_and_mul.py) in both modes: one launch each, the same bits as the torch code
they replace, row-local hence batch-invariant. The CPU keeps the torch code.

`use_autograd_ops(model, ops)` turns both off for a trainer that needs no engine bits (normal
mode): cuBLAS linears, and norms, activation and q/k norm + rope through `ops` (TorchOps: the
torch code here; trainer_bridge/liger_ops.py: kernels with their own backwards), instead of
fused kernels whose backward recomputes their torch code (engine/kernels/torch_backward.py).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import batch_invariant as bi
from engine.kernels import optional_kernel
from engine.kernels.rotary import apply_rotary  # noqa: F401  (the models' rotary; re-exported)

ROPE_TYPES = ("default", "linear", "llama3")


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether x's layer takes the fused Triton kernels: CUDA only. Interpreter tests patch this
    to run them on the CPU under TRITON_INTERPRET=1."""
    return x.is_cuda


def fused_kernel(name: str, x: torch.Tensor) -> Optional[ModuleType]:
    """engine.kernels.<name> if x takes the fused kernels and Triton imports; else None (torch)."""
    return optional_kernel(name) if use_fused_kernels(x) else None


def use_autograd_ops(model: nn.Module, ops: Optional["TorchOps"] = None) -> None:
    """From its next forward every linear of `model` runs cuBLAS and every norm, activation and
    q/k norm + rope runs `ops` (default TorchOps): a normal-mode trainer's choice; the engine
    keeps its kernels."""
    ops = ops or TorchOps()
    for module in model.modules():
        if isinstance(module, Linear):
            module.deterministic = False
            module.small_m_kernel = False
        if hasattr(module, "autograd_ops"):
            module.autograd_ops = ops


class TorchOps:
    """The layers' torch code, differentiable as it is (HF's numerics)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return _rms_norm(x, weight, eps)
        x = x + residual  # the sum becomes the next residual, as in HF's `residual + hidden_states`
        return _rms_norm(x, weight, eps), x

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     norm: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """norm: (q weight, k weight, eps) for Qwen3's RMSNorm over head_dim before rope, or ()."""
        if norm:
            q, k = self.rms_norm(q, norm[0], norm[2]), self.rms_norm(k, norm[1], norm[2])
        return self.rope(q, k, cos, sin)

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (SGLang/vLLM calling convention)."""

    autograd_ops: Optional[TorchOps] = None  # a trainer's (see `use_autograd_ops`)

    def __init__(self, hidden_size: int, eps: float = 1e-6, deterministic: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.deterministic = deterministic

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.autograd_ops is not None:
            return self.autograd_ops.rms_norm(x, self.weight, self.eps, residual)
        if self.deterministic or x.is_cuda:
            # on CUDA the one-kernel Triton norm (fused residual add) replaces ~6 torch kernels
            # per call, same rounding order as below; standalone it took 0.5-1.15x torch's time
            # at M = 1..4096 (H200, scripts/bi_matmul_bench.py); end to end not measured yet
            return bi.rms_norm(x, self.weight, self.eps, residual)
        return TorchOps.rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rope_config(config: Any) -> tuple[float, dict]:
    """(rope_theta, rope parameters) from an HF config.

    transformers 5.x keeps everything in `config.rope_parameters` (theta included, `rope_scaling`
    is an alias); 4.x has `rope_theta` plus an optional `rope_scaling` dict.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0), params


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF Llama/Qwen `rotate_half`); returns float32 cos/sin."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: Optional[dict] = None,
                 max_position_embeddings: Optional[int] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._args = (head_dim, rope_theta, dict(rope_scaling or {}), max_position_embeddings)
        # non-persistent: not a checkpoint tensor; explicit float32 whatever the default dtype
        self.register_buffer("inv_freq", _inv_freq(*self._args), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute the frequencies in place, e.g. after `to_empty` of a meta-built model."""
        with torch.no_grad():
            self.inv_freq.copy_(_inv_freq(*self._args))

    @classmethod
    def from_config(cls, config: Any, head_dim: int) -> "RotaryEmbedding":
        theta, params = rope_config(config)
        return cls(head_dim, theta, params, getattr(config, "max_position_embeddings", None))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim] float32."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _inv_freq(head_dim: int, theta: float, params: dict, max_pos: Optional[int]) -> torch.Tensor:
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}; got {rope_type!r}")
    # same expression as HF so the frequencies are bitwise equal
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params, max_pos)
    return inv_freq.to(device=torch.get_default_device())


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_pos: Optional[int]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params.get("original_max_position_embeddings") or max_pos
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are scaled down by `factor`, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class SiluAndMul(nn.Module):
    """[..., 2*d] (gate | up) -> silu(gate) * up."""

    autograd_ops: Optional[TorchOps] = None  # a trainer's (see `use_autograd_ops`)

    def __init__(self, deterministic: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autograd_ops is not None:
            return self.autograd_ops.silu_and_mul(x)
        fused = fused_kernel("silu_and_mul", x)
        if fused is not None:  # one launch, the bits of this mode's torch code below
            return fused.silu_and_mul(x, stepwise=self.deterministic)
        if self.deterministic:
            return bi.silu_and_mul(x)
        return TorchOps.silu_and_mul(x)


def embedding_weight(num_embeddings: int, embedding_dim: int) -> torch.Tensor:
    """An embedding table left unfilled, for nn.Embedding's `_weight`: the loader fills every
    weight, and nn.Embedding's own normal_ init on the meta device (how models are built) goes
    through torch._refs, whose import of torch._dynamo took 1.6 s of a CPU engine's start-up."""
    return torch.empty(num_embeddings, embedding_dim)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose kernel is fixed at construction.

    `lora`: a forward pass's LoRABatch or LoRAPoolBatch (ForwardBatch.lora), which adds each token's
    adapter delta to this layer's output, found by `lora_name` (the module's name in the model,
    set by the model once built; empty for layers no adapter may target)."""
    lora_name: str = ""
    small_m_kernel: bool = True  # normal mode, a few rows on CUDA: engine.kernels.small_m_linear
    small_m_epilogue: bool = True  # forward_add_norm may fuse (off where the output is summed over ranks)
    small_m_wide: bool = False  # a wide output the small-M kernel takes only under TANDEM_PDL=wide (qkv, gate_up)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 deterministic: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.deterministic = deterministic

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        if self.deterministic:
            det_gemv = fused_kernel("bi_gemv", x) if self.small_m_kernel else None
            if det_gemv is not None and det_gemv.applies(x, self.weight, self.small_m_wide):
                out = det_gemv.bi_gemv(x, self.weight, self.bias)  # the matmul's bits, sooner
            else:
                out = bi.linear(x, self.weight, self.bias)
        else:
            small_m = fused_kernel("small_m_linear", x) if self.small_m_kernel else None
            if small_m is not None and small_m.applies(x, self.weight, wide=self.small_m_wide):
                out = small_m.small_m_linear(x, self.weight, self.bias)
            else:
                out = F.linear(x, self.weight, self.bias)
        return out if lora is None else lora.apply(self.lora_name, x, out)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """self(x) written into `out` (a wider dtype: the cast). Where self(x) would be cuBLAS's
        x @ W.T in out's dtype, cuBLAS writes it there itself: the same GEMM without a temporary
        and a copy (the CUDA graphs' logits, [bs, vocab] a step)."""
        recorded = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)  # out= has no grad
        if out.dtype == x.dtype and not recorded and self._cublas_output(x):
            return torch.mm(x, self.weight.t(), out=out)
        return out.copy_(self(x))

    def _cublas_output(self, x: torch.Tensor) -> bool:
        """Whether self(x) is F.linear's bias-free x @ W.T (not deterministic mode's kernels, not
        the small-M gemv)."""
        if self.deterministic or self.bias is not None or x.dim() != 2:
            return False
        small_m = fused_kernel("small_m_linear", x) if self.small_m_kernel else None
        return small_m is None or not small_m.applies(x, self.weight, wide=self.small_m_wide)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: "RMSNorm", lora: Any = None,
                         act: Optional["SiluAndMul"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(self(act(x)) + residual) and the sum, as `norm(out, residual)` returns them (act:
        None, or the MLP's activation of x = gate | up). A decode batch of a few rows (1..8 by default) on CUDA in
        normal mode runs the linear's split-K sum, the residual add and the norm as one launch
        (and, opt-in, the activation inside the gemv: engine/kernels/small_m_linear.py);
        deterministic mode does too (TANDEM_DET_GEMV, the default), with its batch-invariant bits."""
        if self.deterministic:
            return self._det_add_norm(x if act is None else act(x), residual, norm, lora)
        kernel = self._fused_epilogue(x, norm, lora, act)
        gated = kernel is not None and act is not None and kernel.GATED_PROLOGUE
        if act is not None and not gated:
            x = act(x)
        if kernel is None:
            return norm(self(x, lora), residual)
        return kernel.small_m_linear_add_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps, gated=gated)

    def _det_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: "RMSNorm",
                      lora: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic mode's norm(self(x) + residual): under TANDEM_DET_GEMV (bi_gemv.py, the default), a
        small decode batch takes the gemv with the matmul's splits and the add + norm in its
        split-K sum, whose launch shape and arithmetic are the batch-invariant norm's."""
        det = fused_kernel("bi_gemv", x) if self._epilogue_may_fuse(x, norm, lora) else None
        if det is None or not det.applies_add_norm(x, self.weight):
            return norm(self(x, lora), residual)
        return det.bi_gemv_add_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps)

    def _epilogue_may_fuse(self, x: torch.Tensor, norm: "RMSNorm", lora: Any) -> bool:
        """Either mode: the engine's kernels (no trainer's ops, no adapter delta to add), a norm in
        x's dtype, and an output not summed over ranks after the linear (RowParallelLinear)."""
        return (self.small_m_kernel and self.small_m_epilogue and lora is None and norm.autograd_ops is None
                and norm.weight.dtype == x.dtype)

    def _fused_epilogue(self, x: torch.Tensor, norm: "RMSNorm", lora: Any,
                        act: Optional["SiluAndMul"]) -> Optional[ModuleType]:
        """engine.kernels.small_m_linear where forward_add_norm's launches may fuse, else None."""
        plain = lambda m: m.autograd_ops is None and not m.deterministic  # noqa: E731 (the engine's kernels)
        if not self._epilogue_may_fuse(x, norm, lora) or not plain(norm) or (act is not None and not plain(act)):
            return None
        kernel = fused_kernel("small_m_linear", x)
        return kernel if kernel is not None and kernel.applies_add_norm(x, self.weight) else None


class StackedLinear(Linear):
    """One nn.Linear whose output rows are several checkpoint tensors stacked along dim 0.

    `shard_slice(shard_id)` is the whole loading contract: a checkpoint shard (weight or bias)
    is copied into `param[shard_slice(shard_id)]`.
    """

    def __init__(self, in_features: int, shard_sizes: dict[Any, int], bias: bool,
                 deterministic: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, deterministic)
        self.shard_sizes = dict(shard_sizes)
        self._slices: dict[Any, slice] = {}
        start = 0
        for shard_id, size in self.shard_sizes.items():
            self._slices[shard_id] = slice(start, start + size)
            start += size

    @property
    def shard_ids(self) -> list[Any]:
        return list(self.shard_sizes)

    def shard_slice(self, shard_id: Any) -> slice:
        return self._slices[shard_id]


class QKVLinear(StackedLinear):
    """q_proj, k_proj, v_proj stacked (shard ids "q", "k", "v"); forward returns (q, k, v)."""
    small_m_wide = True

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, deterministic: bool = False) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, deterministic)
        self.output_sizes = [q_size, kv_size, kv_size]

    def forward(self, x: torch.Tensor, lora: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().forward(x, lora).split(self.output_sizes, dim=-1)
        return q, k, v


class MergedGateUp(StackedLinear):
    """gate_proj (shard 0) and up_proj (shard 1) stacked; output feeds SiluAndMul."""
    small_m_wide = True

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 deterministic: bool = False) -> None:
        super().__init__(hidden_size, {0: intermediate_size, 1: intermediate_size}, bias, deterministic)
