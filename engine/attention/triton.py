"""TritonAttentionBackend: KV store + split-KV paged attention, eager or under CUDA graphs.

split_size: the fixed split in deterministic mode (normal-mode decode splits are
length-proportional, at least MIN_DECODE_SPLIT keys; normal extend is one split).

deterministic=True makes every query row's output independent of the batch, of chunking and of
prefill vs decode (DESIGN section 4): fixed `split_size` splits at absolute key positions, one
tile config for extend and decode (see engine/kernels/split_kv_attention.py for the argument).

CUDA graphs (decode only), SGLang style: `init_cuda_graph_state` allocates static metadata and
partial buffers once; `init_forward_metadata_capture(bs, ...)` points the plan at them before
capture; `init_forward_metadata_replay(bs, ...)` rewrites them in place before each replay. The
decode block table is computed on the device from the static seq_lens: under the engine's graphs
that work is captured too (`capture_replay_metadata`), so a replay launches none of it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cascade import CascadeDecode, CascadeTables
from engine.attention.shared_prefix import SharedPrefixPlan
from engine.attention.split_kv_plan import (
    DEFAULT_CONFIGS,
    SINGLE_SPLIT,
    MIN_DECODE_SPLIT,
    KernelConfig,
    SplitKvPlan,
    decode_lanes,
)

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch

# Key split of deterministic mode, and the shortest decode split in normal mode. Part of the
# numerics contract: the trainer's PackedAttention (trainer_bridge) defaults to it on CUDA.
# The layer's fused q/k norm + rope kernel writes the new K/V into the pool (store_kv skipped);
# TANDEM_DISABLE_FUSED_KV_STORE=1 launches store_kv here instead (A/B runs).
FUSED_KV_STORE = os.environ.get("TANDEM_DISABLE_FUSED_KV_STORE", "").strip().lower() in ("", "0", "false", "no", "off")
DEFAULT_SPLIT_SIZE = 256


@dataclass
class _GraphState:
    blocks: torch.Tensor  # int32 [5, max_bs]
    part_acc: Optional[torch.Tensor]
    part_ml: Optional[torch.Tensor]
    max_splits: int
    num_kv_heads: int
    plans: dict  # bs -> SplitKvPlan over the static buffers
    table_in_graph: bool = False  # the graphs compute the block table themselves (capture_replay_metadata)


class TritonAttentionBackend(AttentionBackend):
    runs_dry = True  # its block table comes from the graph's static seq_lens; all else is Triton kernels
    default_split_size = DEFAULT_SPLIT_SIZE  # read by the trainer's PackedAttention

    def __init__(self, deterministic: bool = False, split_size: int = DEFAULT_SPLIT_SIZE,
                 num_sms: Optional[int] = None,
                 configs: Optional[dict[str, KernelConfig]] = None, cascade: bool = True) -> None:
        """cascade: shared-prefix decode (engine/attention/cascade.py) in normal mode."""
        if split_size < 16 or split_size & (split_size - 1):
            raise ValueError(f"split_size must be a power of two >= 16, got {split_size}")
        self.deterministic = deterministic
        self.split_size = split_size
        cfg = {**DEFAULT_CONFIGS, **(configs or {})}
        if configs and "deterministic" in configs and "deterministic_extend" not in configs:
            cfg["deterministic_extend"] = configs["deterministic"]  # a tile of one's own, for both
        # deterministic: prefill's tile is decode's with more rows where that was measured to keep
        # the bits (split_kv_plan.DET_EXTEND_MEASURED), else decode's own: prefill = decode
        self.extend_config = cfg["deterministic_extend"] if deterministic else cfg["extend"]
        self.decode_config = cfg["deterministic"] if deterministic else cfg["decode"]
        self._num_sms = num_sms
        self.plan: Optional[SplitKvPlan] = None
        self.graph: Optional[_GraphState] = None
        self.cascade = CascadeDecode() if cascade and not deterministic else None
        self.cascade_tables: Optional[CascadeTables] = None  # this batch's, when rows share a prefix

    @property
    def wants_shared_prefix(self) -> bool:
        """The runner gives decode batches a SharedPrefixPlan (ForwardBatch.shared_prefix)."""
        return self.cascade is not None

    # ---- per batch -----------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        self.cascade_tables = None
        if fb.forward_mode.is_decode:
            max_len = max(fb.seq_lens_cpu, default=1)
            if self.cascade is not None:
                self.cascade_tables = self.cascade.tables(fb.shared_prefix, fb.seq_lens.device)
            self.plan = self._decode_plan(fb.batch_size, fb.seq_lens, fb.kv_pool.num_kv_heads,
                                          max_len, fb.seq_lens.device, self.cascade_tables)
        else:
            split = self.split_size if self.deterministic else SINGLE_SPLIT
            self.plan = SplitKvPlan(self.extend_config, split,
                                    prefix_lens=list(fb.extend_prefix_lens_cpu),
                                    extend_lens=list(fb.extend_seq_lens_cpu),
                                    keys_config=self.decode_config if self.deterministic else None)

    def _decode_plan(self, bs: int, seq_lens: torch.Tensor, num_kv_heads: int, max_len: int,
                     device: torch.device, cascade: Optional[CascadeTables] = None) -> SplitKvPlan:
        lanes = max_splits = decode_lanes(bs, num_kv_heads, self.num_sms(device))
        split = SINGLE_SPLIT
        if self.deterministic:
            # lanes only change which program computes a split, never its bits
            split, max_splits = self.split_size, math.ceil(max_len / self.split_size)
            lanes = min(lanes, max_splits)
        blocks = torch.empty((5, bs), dtype=torch.int32, device=device)
        self._fill_decode_table(blocks, seq_lens, lanes, cascade)
        return SplitKvPlan(self.decode_config, split, lanes, max_splits, blocks, bs)

    def _fill_decode_table(self, blocks: torch.Tensor, seq_lens: torch.Tensor, lanes: int,
                           cascade: Optional[CascadeTables]) -> None:
        """One launch, no host sync: split_kv_plan's decode_block_table into `blocks`. Splits:
        deterministic mode's fixed size; normal mode's cut each row's keys into `lanes` splits
        (decode_split_lens), with cascade only the keys past its shared prefix (phase A read the rest)."""
        from engine.kernels.decode_table import write_decode_table

        if self.deterministic:
            write_decode_table(blocks, seq_lens, fixed_split=self.split_size)
        else:
            write_decode_table(blocks, seq_lens, lanes=lanes, block_n=self.decode_config.block_n,
                               min_split=MIN_DECODE_SPLIT, prefix_lens=None if cascade is None else cascade.prefix_lens)

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            cuda = device.type == "cuda"
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        return self._num_sms

    # ---- the layer call ------------------------------------------------------------------------
    def kv_store_slots(self, layer_id: int, forward_batch: "ForwardBatch"
                       ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if not FUSED_KV_STORE:
            return None
        return (*forward_batch.kv_pool.get_kv_buffer(layer_id), forward_batch.out_cache_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, forward_batch: "ForwardBatch", kv_stored: bool = False) -> torch.Tensor:
        from engine.kernels.store_kv import store_kv

        fb = forward_batch
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(layer_id)
        if not kv_stored:  # KV first: new keys read like cached ones
            store_kv(k, v, k_buf, v_buf, fb.out_cache_loc)
        prefix = None
        if self.cascade is not None:
            self.cascade.group = q.shape[1] // k_buf.shape[1]
            tables = self.cascade_tables if fb.forward_mode.is_decode else None
            if tables is not None:
                prefix = self.cascade.attend_prefix(q, k_buf, v_buf, tables, fb.req_to_token,
                                                    fb.req_pool_indices, scaling)
        return self.plan.attend(q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, scaling, prefix)

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, num_heads: int,
                              num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        """Static buffers for graphs of up to max_bs sequences of up to max_context_len tokens.
        Partials exist only for batch sizes that use more than one lane."""
        sms = self.num_sms(device)
        partial_bs = [bs for bs in range(1, max_bs + 1) if decode_lanes(bs, num_kv_heads, sms) > 1]
        if self.deterministic:
            max_splits = math.ceil(max_context_len / self.split_size)
        else:
            max_splits = decode_lanes(1, num_kv_heads, sms)
        part_acc = part_ml = None
        if partial_bs and max_splits > 1:
            rows = max(partial_bs)
            part_acc = torch.empty((rows, num_heads, max_splits, head_dim), dtype=torch.float32, device=device)
            part_ml = torch.empty((rows, num_heads, max_splits, 2), dtype=torch.float32, device=device)
        blocks = torch.zeros((5, max_bs), dtype=torch.int32, device=device)
        self.graph = _GraphState(blocks, part_acc, part_ml, max_splits, num_kv_heads, {})
        if self.cascade is not None:
            self.cascade.init_graph_state(max_bs, num_heads, num_kv_heads, head_dim, device)

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor,
                                      seq_lens: torch.Tensor) -> None:
        g = self.graph
        lanes = decode_lanes(bs, g.num_kv_heads, self.num_sms(seq_lens.device))
        lanes = min(lanes, g.max_splits) if self.deterministic else lanes
        if lanes > 1 and g.part_acc is None:
            lanes = 1
        plan = SplitKvPlan(self.decode_config, self.split_size if self.deterministic else SINGLE_SPLIT,
                           lanes, g.max_splits, g.blocks[:, :bs], bs)
        if lanes > 1:
            plan.part_acc, plan.part_ml = g.part_acc[:bs], g.part_ml[:bs]
        g.plans[bs] = plan
        self.init_forward_metadata_replay(bs, req_pool_indices, seq_lens)
        self.cascade_tables = self.cascade.graph_view(bs) if self.cascade is not None else None

    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor,
                                     seq_lens: torch.Tensor,
                                     seq_lens_cpu: Optional[list[int]] = None,
                                     shared_prefix: Optional[SharedPrefixPlan] = None) -> None:
        """seq_lens [bs] on the device (padding rows included); no host sync. seq_lens_cpu (their
        host copy, for backends that plan on the host) is not needed here. shared_prefix: the
        batch's plan, for graphs captured with phase A (CascadeDecode.graph_view)."""
        self.plan = self.graph.plans[bs]
        if self.cascade is not None:
            self.cascade.refill(bs, shared_prefix)
        if not self.graph.table_in_graph:
            self._write_decode_table(bs, seq_lens)

    def capture_replay_metadata(self, bs: int, seq_lens: torch.Tensor) -> None:
        """The block table's ~13 small device ops, recorded in the graph of bs (about 80 us of
        host launches a step at batch 1 otherwise)."""
        self._write_decode_table(bs, seq_lens)
        self.graph.table_in_graph = True

    def _write_decode_table(self, bs: int, seq_lens: torch.Tensor) -> None:
        """The graph plan of bs's block table from seq_lens [bs]."""
        plan = self.graph.plans[bs]
        view = self.cascade.graph_view(bs) if self.cascade is not None else None
        self._fill_decode_table(plan.blocks, seq_lens[:bs], plan.lanes, view)
