"""AttentionBackend: the interface every attention backend implements.

Backends are listed, with what they support, in engine/attention/registry.py (BackendSpec); that
is where a new one is registered and how the runner creates one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Writes the new K/V into the pool first, then attends each new query over its sequence."""

    wants_shared_prefix = False  # True: decode batches carry a SharedPrefixPlan (cascade decode)
    # True: its decode pass may run dry (engine/kernels/compile_ahead.py): every device read of an
    # index it computes is a Triton kernel's, or a torch op's over the graph's static inputs
    runs_dry = False

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
        """A backend whose kv_store_slots gives slots also takes kv_stored=True: K/V are in the pool."""

    def kv_store_slots(self, layer_id: int, forward_batch: "ForwardBatch"
                       ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(k pool buffer, v pool buffer, slot ids) where the caller may write this layer's new K/V
        itself, as the fused q/k norm + rope kernel does in its own launch; the layer then calls
        forward(..., kv_stored=True). None (this default): forward writes them."""
        return None

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    # Called by engine/runner/cuda_graph.py, only for backends whose BackendSpec says
    # supports_cuda_graph: static buffers once, then a plan over them before capture and before
    # every replay (in place, no host sync).
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, num_heads: int,
                              num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        """Static metadata buffers for graphs of up to max_bs sequences of max_context_len tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs "
                                  "(its BackendSpec must say supports_cuda_graph=False)")

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor,
                                      seq_lens: torch.Tensor) -> None:
        """Before capturing the graph of batch size bs: point the plan at the static buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor,
                                     seq_lens: torch.Tensor,
                                     seq_lens_cpu: Optional[list[int]] = None,
                                     shared_prefix: Any = None) -> None:
        """Before each replay: seq_lens [bs] on the device (padding rows included); seq_lens_cpu,
        their host copy, for backends that plan on the host; shared_prefix, the batch's
        SharedPrefixPlan (for backends whose wants_shared_prefix is True; others ignore it)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def capture_replay_metadata(self, bs: int, seq_lens: torch.Tensor) -> None:
        """Called inside the capture of the graph of batch size bs, before the model: device-only
        plan work from the static seq_lens that the graph then replays itself, so that
        init_forward_metadata_replay need not launch it from the host each step. Default: none."""
