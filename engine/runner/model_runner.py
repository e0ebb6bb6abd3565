"""ModelRunner: the one place where a host-side batch becomes device tensors and a forward pass.

It owns the model, the KV pool and the attention backend; it turns a ScheduleBatch into a
ForwardBatch, runs the model, then samples and computes the logprobs the requests asked for
(engine/runner/runner_outputs.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from engine.attention.registry import create_attention_backend, get_backend_spec
from engine.attention.shared_prefix import SharedPrefixFinder
from engine.kernels import batch_invariant as bi
from engine.grammar.mask_prefetch import MaskPrefetch
from engine.grammar.bitmask_ring import BitmaskRing
from engine.grammar.stream_gate import StreamGate
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kernels.device_copy import h2d
from engine.forward_batch import ForwardBatch
from engine.lora.lora_batch import LoRABatch
from engine.runner.logits_plan import LogitsPlan
from engine.runner.memory_saver import MemorySaver
from engine.runner.runner_memory import RunnerMemory
from engine.runner.runner_outputs import RunnerOutputs
from engine.sampling.sampler import Sampler
from engine.runner.pending_result import PendingResult
from engine.scheduler.batch import ScheduleBatch

if TYPE_CHECKING:
    from engine.lora.lora_pool import LoRAPool
    from engine.runner.tp_driver import TPDriver


@dataclass(frozen=True)
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    cuda_graph_max_bs: int = 0  # 0: decode runs eagerly (CPU, torch backend, --disable-cuda-graph)
    deterministic: bool = False  # batch-invariant attention and log_softmax (the model is built so too)
    cascade_attn: bool = True  # shared-prefix decode where the backend has it (normal mode only)


def backend_options(config: RunnerConfig) -> dict:
    """The attention backend's settings: deterministic, and cascade where it has one."""
    options: dict[str, Any] = {"deterministic": config.deterministic}
    if get_backend_spec(config.attention_backend).supports_cascade:
        options["cascade"] = config.cascade_attn
    return options


class ModelRunner(RunnerMemory, RunnerOutputs):
    def __init__(self, config: RunnerConfig, model: torch.nn.Module, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                 memory_saver: Optional[MemorySaver] = None, tp: Optional["TPDriver"] = None,
                 lora_pool: Optional["LoRAPool"] = None):
        self.config = config
        self.tp = tp  # rank 0's TPDriver when tp_size > 1: every pass is sent to the other ranks first
        self.device = config.device
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.attn_backend = create_attention_backend(config.attention_backend, **backend_options(config))
        # cascade decode: rows sharing a cached prefix read its KV once (rank 0 alone plans, so not with TP)
        self.shared_prefix = (SharedPrefixFinder()
                              if self.attn_backend.wants_shared_prefix and tp is None else None)
        self.log_softmax = bi.log_softmax if config.deterministic else None
        self.sampler = Sampler(log_softmax=self.log_softmax)
        # the lookahead step's bitmask, filled during the commit; on CUDA the device waits for it
        self.grammar_masks = MaskPrefetch(StreamGate.create(self.device))
        self.grammar_bitmasks = BitmaskRing(config.vocab_size, self.device)
        self.memory_saver = memory_saver or MemorySaver(False, self.device)
        # a region freed while released would be unmapped twice: bring it back before the runner goes
        weakref.finalize(self, self.memory_saver.resume_all).atexit = False
        # The scheduler keeps req_to_token on the host; the device keeps a mirror it updates
        # with just the entries each batch touches.
        host_table = req_to_token_pool.req_to_token
        with self.memory_saver.region("kv_cache"):  # stale with the KV: rows are rewritten at each prefill
            self.req_to_token = host_table if host_table.device == self.device else torch.zeros_like(host_table, device=self.device)
        self._buffers_backup: dict[str, torch.Tensor] = {}  # model buffers while the weights are released
        self.lora_adapters: Optional[dict] = None  # id -> engine.lora.LoRAAdapter, with --enable-lora
        self.lora_pool = lora_pool  # the Triton path's adapter slots (None: the torch path), graphs read it
        self.cuda_graph = self._capture_graphs() if self._graphs_wanted() else None
        graph_logits = (self.cuda_graph.logits.dtype,) if self.cuda_graph is not None else ()
        self.sampler.warmup(self.device, config.vocab_size, (torch.float32, *graph_logits))

    @torch.inference_mode()
    def launch(self, batch: ScheduleBatch, inflight: Optional[PendingResult] = None) -> PendingResult:
        """Runs the forward pass and sampling without waiting for the device. A lookahead batch
        takes its input ids from `inflight`, the still unresolved previous decode step."""
        return self.sample(self.forward(batch, inflight))

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch, inflight: Optional[PendingResult] = None) -> "ForwardOutput":
        """The forward pass alone (queued on the device): sampling can be launched later, once the
        host has what it reads (a grammar's mask after the previous step is committed)."""
        fb, table_entries = self._forward_batch(batch, inflight)
        plan = LogitsPlan.build(batch)
        if self.tp is None:
            return ForwardOutput(batch, plan, self._logits(fb, plan))
        self.tp.send_forward(batch, fb, plan.rows, table_entries)  # the ranks join the pass
        try:
            return ForwardOutput(batch, plan, self._logits(fb, plan))
        except Exception as exc:  # the other ranks are left inside this pass's collectives
            self.tp.abandon(f"rank 0's forward pass failed ({type(exc).__name__}: {exc})")
            raise

    def _logits(self, fb: ForwardBatch, plan: LogitsPlan) -> torch.Tensor:
        if self.cuda_graph is not None and self.cuda_graph.can_run(fb):
            return self.cuda_graph.replay(fb)  # decode: plan.rows is every row, in order
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden[h2d(plan.rows, self.device)])

    @torch.inference_mode()
    def sample(self, forward: "ForwardOutput") -> PendingResult:
        """Sampling of a forward pass; the next forward must not be launched before this (CUDA
        graphs share one logits buffer)."""
        return self._sample(forward.batch, forward.plan, forward.logits)

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks' processes, then frees the CUDA graphs and their pool."""
        self.grammar_masks.shutdown()
        if self.tp is not None:
            self.tp.stop()
        self.memory_saver.resume_all()  # a region freed while unmapped would be unmapped twice
        if self.cuda_graph is not None:
            self.cuda_graph.release()
            self.cuda_graph = None
        self.memory_saver.drop_graph_pool()  # on this thread, which may free into the saver's regions

    # ---- inputs --------------------------------------------------------------------------------
    def _forward_batch(self, batch: ScheduleBatch,
                       inflight: Optional[PendingResult]) -> tuple[ForwardBatch, Optional[torch.Tensor]]:
        """-> the pass's ForwardBatch, and the req_to_token entries device copies of the table need
        before it (`_table_entries`), for tensor-parallel ranks."""
        seq_lens = batch.seq_lens()
        req_pool_indices = [r.req_pool_idx for r in batch.reqs]
        lookahead = batch.lookahead and inflight is not None
        input_ids = [] if lookahead else batch.input_ids()
        # one host buffer, one copy to the device: small copies cost more than their bytes
        packed = torch.cat([
            torch.tensor(input_ids + batch.positions() + req_pool_indices + seq_lens, dtype=torch.int64),
            batch.out_cache_loc])
        packed = h2d(packed, self.device)
        t, b = len(batch.out_cache_loc), batch.batch_size
        sizes = [len(input_ids), t, b, b, t]
        ids, positions, rows, lens, out_cache_loc = torch.split(packed, sizes)
        if lookahead:
            ids = inflight.next_token_ids
            if batch.lookahead_rows is not None and len(batch.lookahead_rows) != len(ids):
                ids = ids[h2d(torch.tensor(batch.lookahead_rows), self.device)]
        fb = ForwardBatch(
            forward_mode=batch.forward_mode, input_ids=ids, positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=rows, seq_lens=lens,
            seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=list(batch.prefix_lens),
            extend_seq_lens_cpu=list(batch.extend_lens), req_to_token=self.req_to_token,
            kv_pool=self.kv_pool, attn_backend=self.attn_backend,
        )
        if self.lora_adapters is not None:
            fb.lora = self._lora_batch([r.lora_id for r in batch.reqs], list(batch.extend_lens))
        if self.shared_prefix is not None and batch.forward_mode.is_decode:
            pool = self.req_to_token_pool
            fb.shared_prefix = self.shared_prefix.find(batch.reqs, pool.req_to_token, req_pool_indices,
                                                       seq_lens, pool.generation)
        return fb, self._sync_req_to_token(fb, batch)

    def _lora_batch(self, lora_ids: list[Optional[int]], tokens_per_req: list[int]) -> Any:
        """The pass's LoRA: the pool's (Triton, its adapters made resident) or the torch path's."""
        det = self.config.deterministic
        if self.lora_pool is not None:
            return self.lora_pool.prepare(lora_ids, tokens_per_req, self.lora_adapters, det)
        return LoRABatch.build(lora_ids, tokens_per_req, self.lora_adapters, self.device, det)

    def _sync_req_to_token(self, fb: ForwardBatch, batch: ScheduleBatch) -> Optional[torch.Tensor]:
        """Brings the device's copy of the table up to date for this pass; -> the entries it took
        (None without any copy to keep: the table on the CPU, no tensor-parallel ranks)."""
        pool = self.req_to_token_pool
        mirrored = pool.req_to_token is not self.req_to_token
        if not mirrored and self.tp is None:
            pool.take_written()  # nothing copies the host table
            return None
        entries = self._table_entries(batch, fb.seq_lens_cpu)
        if mirrored:
            if entries is not None:
                rows, cols, slots = h2d(entries, self.device)
                self.req_to_token[rows, cols] = slots
            if batch.forward_mode.is_decode:  # one new entry per request, at its position
                self.req_to_token[fb.req_pool_indices, fb.positions] = fb.out_cache_loc
        return entries

    def _table_entries(self, batch: ScheduleBatch, seq_lens: list[int]) -> Optional[torch.Tensor]:
        """[3, n] host (row, column, slot) entries a copy of req_to_token needs before this pass,
        besides a decode step's one new entry per request: the rows a commit pointed at the radix
        tree's slots since the last pass, and a prefill's whole rows (their prefix came from the
        cache), snapshotted so later host edits of the table cannot race the transfer."""
        pool = self.req_to_token_pool
        if batch.forward_mode.is_decode:
            return pool.take_written()
        written = pool.take_written({r.req_pool_idx for r in batch.reqs})
        rows = torch.cat([torch.full((n,), r.req_pool_idx, dtype=torch.int64) for r, n in zip(batch.reqs, seq_lens)])
        cols = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens])
        whole = torch.stack([rows, cols, pool.req_to_token[rows, cols]])
        return whole if written is None else torch.cat([written, whole], 1)

    def _graphs_wanted(self) -> bool:
        return self.config.cuda_graph_max_bs > 0

    def _capture_graphs(self):
        from engine.runner.cuda_graph import CudaGraphRunner

        return CudaGraphRunner(self.model, self.attn_backend, self.kv_pool, self.req_to_token, self.device,
                               self.config.cuda_graph_max_bs, lora_pool=self.lora_pool,
                               deterministic=self.config.deterministic, graph_pool=self.memory_saver.graph_pool())


@dataclass
class ForwardOutput:
    """A launched forward pass waiting for its sampling."""
    batch: ScheduleBatch
    plan: LogitsPlan
    logits: torch.Tensor
