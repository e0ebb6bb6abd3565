"""ModelRunner: the one place where a host-side batch becomes device tensors and a forward pass.

It owns the model, the KV pool and the attention backend; it turns a ScheduleBatch into a
ForwardBatch, runs the model, samples, and computes the logprobs the requests asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.base import create_attention_backend
from engine.kernels import batch_invariant as bi
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.runner.forward_batch import ForwardBatch
from engine.runner.logits_plan import LogitsPlan
from engine.sampling.logprobs import gather_token_logprobs, original_logprobs, top_logprobs
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_batch import SamplingBatch, SamplingRow
from engine.schedule_batch import BatchResult, ScheduleBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    cuda_graph_max_bs: int = 0  # 0: decode runs eagerly (CPU, torch backend, --disable-cuda-graph)
    deterministic: bool = False  # batch-invariant attention and log_softmax (the model is built so too)


class ModelRunner:
    def __init__(self, config: RunnerConfig, model: torch.nn.Module, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool):
        self.config = config
        self.device = config.device
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.attn_backend = create_attention_backend(config.attention_backend, deterministic=config.deterministic)
        self.log_softmax = bi.log_softmax if config.deterministic else None
        self.sampler = Sampler(log_softmax=self.log_softmax)
        # The scheduler keeps req_to_token on the host; the device keeps a mirror it updates
        # with just the entries each batch touches.
        host_table = req_to_token_pool.req_to_token
        self.req_to_token = host_table if host_table.device == self.device else torch.zeros_like(host_table, device=self.device)
        self.cuda_graph = None
        if config.cuda_graph_max_bs > 0:
            from engine.runner.cuda_graph import CudaGraphRunner

            self.cuda_graph = CudaGraphRunner(model, self.attn_backend, kv_pool, self.req_to_token,
                                              self.device, config.cuda_graph_max_bs)

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> BatchResult:
        fb = self._forward_batch(batch)
        plan = LogitsPlan.build(batch)
        if self.cuda_graph is not None and self.cuda_graph.can_run(fb):
            logits = self.cuda_graph.replay(fb)  # decode: plan.rows is every row, in order
        else:
            self.attn_backend.init_forward_metadata(fb)
            hidden = self.model(fb.input_ids, fb.positions, fb)
            logits = self.model.compute_logits(hidden[plan.rows.to(self.device)])
        return self._sample(batch, plan, logits)

    # ---- inputs --------------------------------------------------------------------------------
    def _forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        seq_lens = batch.seq_lens()
        req_pool_indices = [r.req_pool_idx for r in batch.reqs]
        self._sync_req_to_token(req_pool_indices, seq_lens, batch)
        return ForwardBatch(
            forward_mode=batch.forward_mode,
            input_ids=dev(batch.input_ids()),
            positions=dev(batch.positions()),
            out_cache_loc=batch.out_cache_loc.to(self.device, non_blocking=True),
            req_pool_indices=dev(req_pool_indices),
            seq_lens=dev(seq_lens),
            extend_prefix_lens=dev(batch.prefix_lens),
            extend_seq_lens=dev(batch.extend_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(batch.prefix_lens),
            extend_seq_lens_cpu=list(batch.extend_lens),
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

    def _sync_req_to_token(self, rows: list[int], seq_lens: list[int], batch: ScheduleBatch) -> None:
        host = self.req_to_token_pool.req_to_token
        if host is self.req_to_token:
            return
        if batch.forward_mode.is_decode:  # one new entry per request
            idx = torch.tensor(rows, dtype=torch.int64)
            pos = torch.tensor(batch.prefix_lens, dtype=torch.int64)
            self.req_to_token[idx.to(self.device), pos.to(self.device)] = batch.out_cache_loc.to(self.device)
            return
        for row, n in zip(rows, seq_lens):  # prefill: whole rows (prefix may come from the cache)
            self.req_to_token[row, :n].copy_(host[row, :n], non_blocking=True)

    # ---- outputs -------------------------------------------------------------------------------
    def _sample(self, batch: ScheduleBatch, plan: LogitsPlan, logits: torch.Tensor) -> BatchResult:
        last = logits[plan.last_rows.to(self.device)]
        rows = [self._sampling_row(r) for r in batch.reqs]
        sampling = SamplingBatch.build(rows, self.config.vocab_size, self.device)
        out = self.sampler.sample(last, sampling)
        processed = [r.logprob_distribution == "processed" for r in batch.reqs]
        chosen = torch.where(torch.tensor(processed, device=self.device), out.processed_logprobs, out.original_logprobs)
        result = BatchResult(next_token_ids=out.next_token_ids.tolist(), logprobs=chosen.tolist())
        result.top_logprobs = self._top_logprobs(batch, last)
        result.input_logprobs = self._input_logprobs(plan, logits)
        return result

    def _sampling_row(self, req) -> SamplingRow:
        params = req.sampling_params
        suppress: list[int] = []
        if len(req.output_ids) < params.min_new_tokens:
            suppress = list(self.config.eos_token_ids) + list(params.stop_token_ids or [])
        return SamplingRow(
            params=params, seed=req.seed, position=len(req.fill_ids),
            prompt_ids=req.origin_input_ids, output_ids=req.output_ids, suppress_ids=suppress,
        )

    def _top_logprobs(self, batch: ScheduleBatch, last: torch.Tensor) -> list:
        k = max((r.top_logprobs_num for r in batch.reqs), default=0)
        if k == 0:
            return [None] * batch.batch_size
        values, ids = top_logprobs(last, k, self.log_softmax)
        values, ids = values.tolist(), ids.tolist()
        return [
            list(zip(values[i][: r.top_logprobs_num], ids[i][: r.top_logprobs_num])) if r.top_logprobs_num else None
            for i, r in enumerate(batch.reqs)
        ]

    def _input_logprobs(self, plan: LogitsPlan, logits: torch.Tensor) -> list[list[float]]:
        if not plan.num_prompt_rows:
            return [[] for _ in plan.prompt_row_counts]
        rows = plan.prompt_rows.to(self.device)
        targets = plan.prompt_targets.to(self.device)
        values = gather_token_logprobs(original_logprobs(logits[rows], self.log_softmax), targets).tolist()
        out, offset = [], 0
        for n in plan.prompt_row_counts:
            out.append(values[offset : offset + n])
            offset += n
        return out
