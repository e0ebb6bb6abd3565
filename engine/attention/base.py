"""Attention backends: one interface, registered by name, imported lazily."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from engine.runner.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Writes the new K/V into the pool first, then attends each new query over its sequence."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Called once per batch before the model runs; plans shared by all layers go here."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer_id: int,
        scaling: float,
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


_REGISTRY: dict[str, Callable[[], type[AttentionBackend]]] = {}


def register_backend(name: str, loader: Callable[[], type[AttentionBackend]]) -> None:
    _REGISTRY[name] = loader


def create_attention_backend(name: str, **options: Any) -> AttentionBackend:
    """options: backend settings such as deterministic=True (fixed KV splits, see DESIGN §4)."""
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {sorted(_REGISTRY)}; got {name!r}")
    return _REGISTRY[name]()(**options)


def _load_torch_native() -> type[AttentionBackend]:
    from engine.attention.torch_native import TorchNativeAttentionBackend

    return TorchNativeAttentionBackend


register_backend("torch", _load_torch_native)


def _load_triton() -> type[AttentionBackend]:
    from engine.attention.triton import TritonAttentionBackend

    return TritonAttentionBackend


register_backend("triton", _load_triton)


def _load_flashinfer() -> type[AttentionBackend]:
    from engine.attention.flashinfer import FlashInferAttentionBackend

    return FlashInferAttentionBackend


register_backend("flashinfer", _load_flashinfer)
