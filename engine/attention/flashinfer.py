"""FlashInferAttentionBackend: KV store + flashinfer's paged attention, eager or under CUDA graphs.

The pool is a flashinfer paged cache whose pages hold one token: k_buf.view(-1, 1, Hkv, D) is
the NHD page tensor, a sequence's page list is its req_to_token row (kv_indices, built on the
device by engine/kernels/kv_indices.py) and every last page is full (last_page_len = 1).

Extend (prefill, over a cached prefix, chunked, mixed): BatchPrefillWithPagedKVCacheWrapper,
causal, over each whole sequence; the new tokens' KV is stored first so they read like cached
ones. Decode: BatchDecodeWithPagedKVCacheWrapper; use_tensor_cores (default) runs it on the
prefill kernel with one query row per sequence, usually the faster choice for GQA on Hopper, and
shares the extend's JIT module, so a cold start compiles one module, not two (False: flashinfer's
CUDA-core decode kernel, a second module).

Plans: plan() runs flashinfer's scheduler on host copies of the indptr arrays. They are built
from the ForwardBatch's host lists in pinned memory, so their copies to the device do not wait
for the GPU (one flashinfer makes itself, of a pageable qo_indptr in eager decode, may: graph
replays skip it). One plan per batch, made at the first layer call (the query head count, dtype
and scale are known there) and reused by the other layers. A wrapper's next plan waits for its
previous plan's copy out of the wrapper's one pinned buffer (an event per wrapper).

The page table is built at layer 0, which starts every forward pass. CUDA graphs (decode only):
one wrapper per captured batch size over static indptr / indices / last_page_len buffers; the
page-table launch is captured with the layers, and plan() runs again before every replay, with
the host seq_lens the graph runner passes in, rewriting the scheduler data the captured kernels
read.

flashinfer is float16/bfloat16 only, and its split-KV choices follow the batch, so it has no
deterministic mode: use the triton or torch backend for either.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from engine.attention.base import AttentionBackend
from engine.attention.registry import get_backend_spec

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch

# float workspace shared by all wrappers: split-KV decode temporaries grow with batch x heads
# (Qwen3-8B at bs 256 needed 160 MiB; 128 MiB, flashinfer's example size, overflowed)
WORKSPACE_BYTES = 512 * 1024 * 1024
SPEC = get_backend_spec("flashinfer")  # its dtypes and head sizes (those it builds kernels for)
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in SPEC.dtypes)
INSTALL_HINT = ("attention_backend 'flashinfer' needs the flashinfer-python package (pip install "
                "flashinfer-python; on the GPU machine, `source .devkit/install.sh`), or use "
                "--attention-backend triton or torch")


@dataclass
class _Plan:
    """One batch's flashinfer inputs; `key` is what the wrapper was last planned for."""
    wrapper: Any
    decode: bool
    kv_indptr: torch.Tensor  # host int32 [B + 1], pinned
    kv_lens: torch.Tensor  # host int32 [B], pinned
    qo_indptr: Optional[torch.Tensor]  # host int32 [B + 1], pinned; extend only
    kv_indptr_dev: torch.Tensor  # device int32 [B + 1], read by the page-table kernel
    kv_indices: torch.Tensor  # device int32 [total], filled at layer 0
    key: Optional[tuple] = None  # (q heads, kv heads, head_dim, q dtype, kv dtype, scale)


@dataclass
class _GraphState:
    indptr: torch.Tensor  # int32 [max_bs + 1]
    indices: torch.Tensor  # int32 [max_bs * max_context_len]
    last_page_len: torch.Tensor  # int32 [max_bs], ones
    wrappers: dict  # bs -> decode wrapper over the buffers above
    key: Optional[tuple] = None  # the layers' plan key, learnt at the capture warm-up


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, deterministic: bool = False, use_tensor_cores: bool = True,
                 prefill_backend: str = "fa2") -> None:
        if deterministic:
            raise ValueError("attention_backend 'flashinfer' has no deterministic mode: "
                             "deterministic inference needs the triton (GPU) or torch backend")
        try:
            import flashinfer
        except (ImportError, OSError) as e:
            raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
        self._fi = flashinfer
        self.use_tensor_cores = use_tensor_cores
        self.prefill_backend = prefill_backend  # "fa2" shares the tensor-core decode's JIT module
        self.workspace: Optional[torch.Tensor] = None
        self._prefill = self._decode = None
        self._ones: Optional[torch.Tensor] = None
        self.plan: Optional[_Plan] = None
        self.graph: Optional[_GraphState] = None
        self._copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan's copy

    # ---- per batch -----------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        device = fb.seq_lens.device
        _check(fb.kv_pool.dtype, device)
        decode = fb.forward_mode.is_decode
        if decode:
            if self._decode is None:
                self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(device), "NHD", use_tensor_cores=self.use_tensor_cores)
            wrapper = self._decode
        else:
            if self._prefill is None:
                self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace(device), "NHD", backend=self.prefill_backend)
            wrapper = self._prefill
        extend_lens = None if decode else fb.extend_seq_lens_cpu
        kv_indptr, kv_lens, qo_indptr = _host_arrays(fb.seq_lens_cpu, extend_lens)
        total = int(kv_indptr[-1])
        self.plan = _Plan(wrapper, decode, kv_indptr, kv_lens, qo_indptr,
                          kv_indptr.to(device, non_blocking=True),
                          torch.empty(total, dtype=torch.int32, device=device))

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self.workspace is None:  # zeroed: flashinfer expects that on first use
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self.workspace

    def _plan(self, plan: _Plan, key: tuple) -> None:
        num_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scaling = key
        for dtype in (q_dtype, kv_dtype):
            _check(dtype, self.workspace.device)
        bs = plan.kv_lens.numel()
        last_page_len = self._host_ones(bs)
        # plan() writes the wrapper's pinned host buffer, then copies it to the device without
        # waiting; under overlap scheduling the previous plan's copy may still be queued behind
        # the running batch, so wait for it (it has almost always run: this costs ~nothing)
        copied = self._copied.get(id(plan.wrapper))
        if copied is not None:
            copied.synchronize()
        if plan.decode:
            plan.wrapper.plan(plan.kv_indptr, plan.kv_indices, last_page_len, num_heads, num_kv_heads,
                              head_dim, 1, q_data_type=q_dtype, kv_data_type=kv_dtype,
                              sm_scale=scaling, seq_lens=plan.kv_lens)
        else:
            # seq_lens (pinned) spares plan() a pageable copy of the kv lengths it derives
            plan.wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, last_page_len,
                              num_heads, num_kv_heads, head_dim, 1, causal=True, sm_scale=scaling,
                              q_data_type=q_dtype, kv_data_type=kv_dtype, seq_lens=plan.kv_lens)
        plan.key = key
        if self.workspace.is_cuda:  # (the CPU tests' stand-in flashinfer has no copies)
            self._copied.setdefault(id(plan.wrapper), torch.cuda.Event()).record()
        if plan.decode and plan.wrapper.is_cuda_graph_enabled:
            self.graph.key = key

    def _host_ones(self, n: int) -> torch.Tensor:
        if self._ones is None or self._ones.numel() < n:  # never rewritten: safe to share pinned
            self._ones = _pinned(torch.ones(max(n, 256), dtype=torch.int32))
        return self._ones[:n]

    # ---- the layer call ------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scaling: float, forward_batch: "ForwardBatch") -> torch.Tensor:
        from engine.kernels.kv_indices import build_kv_indices
        from engine.kernels.store_kv import store_kv

        fb, plan = forward_batch, self.plan
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(layer_id)
        store_kv(k, v, k_buf, v_buf, fb.out_cache_loc)  # KV first: new keys read like cached ones
        key = (q.shape[1], k_buf.shape[1], k_buf.shape[2], q.dtype, k_buf.dtype, scaling)
        if plan.key != key:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer plans on the host: run the batch once before capturing it")
            self._plan(plan, key)
        if layer_id == 0:  # a forward pass starts; under a graph this launch is captured too
            build_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, plan.kv_indptr_dev,
                             plan.kv_indices)
        pages = (k_buf.view(-1, 1, *k_buf.shape[1:]), v_buf.view(-1, 1, *v_buf.shape[1:]))
        # flashinfer reads q through its token and head strides: a view into the qkv output is fine
        return plan.wrapper.run(q if q.stride(-1) == 1 else q.contiguous(), pages)

    # ---- CUDA graphs (decode) ------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int, num_heads: int,
                              num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        """Static buffers for graphs of up to max_bs sequences of up to max_context_len tokens
        (a radix cache shares prefixes, so the total can exceed the pool: size for the worst)."""
        self._workspace(device)
        i32 = dict(dtype=torch.int32, device=device)
        self.graph = _GraphState(torch.zeros(max_bs + 1, **i32),
                                 torch.zeros(max_bs * max_context_len, **i32),
                                 torch.ones(max_bs, **i32), {})

    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor,
                                      seq_lens: torch.Tensor) -> None:
        g = self.graph
        if bs not in g.wrappers:
            g.wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g.indptr[:bs + 1], paged_kv_indices_buffer=g.indices,
                paged_kv_last_page_len_buffer=g.last_page_len[:bs])
        self.init_forward_metadata_replay(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor,
                                     seq_lens: torch.Tensor,
                                     seq_lens_cpu: Optional[list[int]] = None,
                                     shared_prefix: Any = None) -> None:
        """seq_lens [bs] on the device (padding rows included); seq_lens_cpu, their host copy,
        spares a device sync (without it they are read back: fine at capture, not per step)."""
        g = self.graph
        lens = list(seq_lens_cpu) if seq_lens_cpu is not None else seq_lens[:bs].tolist()
        kv_indptr, kv_lens, _ = _host_arrays(lens[:bs], None)
        total = int(kv_indptr[-1])
        # plan() copies kv_indptr into g.indptr, where the captured page-table kernel reads it;
        # the indices slice is the wrapper's own buffer, so plan() copies nothing there
        plan = _Plan(g.wrappers[bs], True, kv_indptr, kv_lens, None, g.indptr[:bs + 1],
                     g.indices[:total])
        if g.key is not None:  # else the capture warm-up plans at its first layer
            self._plan(plan, g.key)
        self.plan = plan


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"attention_backend 'flashinfer' supports float16 and bfloat16 only, got "
                         f"{dtype}: use --dtype bfloat16, or --attention-backend triton or torch")


def _check(dtype: torch.dtype, device: torch.device) -> None:
    check_dtype(dtype)
    if device.type != "cuda":
        raise RuntimeError("attention_backend 'flashinfer' needs a CUDA device")


def _host_arrays(seq_lens: list[int], extend_lens: Optional[list[int]]):
    """-> kv_indptr [B + 1], kv_lens [B], qo_indptr [B + 1] or None: int32 views of one pinned
    host tensor (the caching host allocator keeps it until the copies that read it have run)."""
    values = [0, *itertools.accumulate(seq_lens), *seq_lens]
    if extend_lens is not None:
        values += [0, *itertools.accumulate(extend_lens)]
    host = _pinned(torch.tensor(values, dtype=torch.int32))
    n = len(seq_lens)
    qo_indptr = host[2 * n + 1:] if extend_lens is not None else None
    return host[:n + 1], host[n + 1:2 * n + 1], qo_indptr


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if torch.cuda.is_available() else t
