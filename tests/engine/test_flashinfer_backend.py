"""The flashinfer attention backend on the CPU, where flashinfer does not exist.

Always: the clear errors (deterministic mode, package missing, float32). Where Triton is
installed (its CPU interpreter runs store_kv and the page-table kernel): the backend's plumbing
(page table, indptr arrays, one plan per batch, the CUDA-graph capture/replay flow with padding)
against the torch oracle, over a stand-in flashinfer whose wrappers take the 0.5.3 signatures and
compute in torch. The real kernels are checked in tests/gpu/test_flashinfer_attention_gpu.py.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from engine.attention.registry import create_attention_backend
from engine.config import ServerArgs

CPU = not torch.cuda.is_available()
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton


def test_deterministic_mode_is_refused():
    with pytest.raises(ValueError, match="deterministic inference needs the triton .* or torch"):
        create_attention_backend("flashinfer", deterministic=True)
    with pytest.raises(ValueError, match="no deterministic mode"):
        ServerArgs(model_path="m", attention_backend="flashinfer", enable_deterministic_inference=True)


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match=r"flashinfer-python.*triton or torch"):
        create_attention_backend("flashinfer")


def test_float32_is_refused(monkeypatch):
    from engine.attention.flashinfer import _check

    with pytest.raises(ValueError, match="float16 and bfloat16 only"):
        _check(torch.float32, torch.device("cuda"))


def test_unsupported_head_dim_is_refused_before_the_model_loads(tiny_model_dir):
    from engine.core.setup import build_core_parts

    # the tiny model's head_dim (16) is not one flashinfer builds kernels for
    args = ServerArgs(model_path=tiny_model_dir, attention_backend="flashinfer", dtype="bfloat16",
                      device="cpu")
    with pytest.raises(ValueError, match=r"supports head_dim 64, 128, 256, this model has 16"):
        build_core_parts(args)


# ---- a stand-in flashinfer -----------------------------------------------------------------------
PLANS = []  # every plan() call, to count them


def _host_int32(t, name):
    assert t.dtype == torch.int32, f"{name} must be int32"
    assert t.device.type == "cpu", f"{name} must be a host tensor (a device one costs a sync)"


class _Wrapper:
    """Stores the plan like flashinfer (copies into the static buffers in CUDA-graph mode) and
    attends in torch from the buffers at run time, so a page table built late is what runs."""

    def _store(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
               head_dim, page_size, causal, sm_scale, q_data_type, kv_data_type, seq_lens):
        _host_int32(indptr, "kv_indptr")
        _host_int32(last_page_len, "last_page_len")
        _host_int32(seq_lens, "seq_lens")
        assert indices.dtype == torch.int32 and page_size == 1
        assert len(indices) == int(indptr[-1])
        assert torch.equal(seq_lens, indptr[1:] - indptr[:-1]) and bool((last_page_len == 1).all())
        if self.graph:
            assert len(last_page_len) == len(self.last_buf) and len(indices) <= len(self.indices_buf)
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last_page_len)
            self.indices_buf[:len(indices)].copy_(indices)
        else:
            self.indptr_buf, self.indices_buf, self.last_buf = indptr.clone(), indices, last_page_len
        self.qo_indptr = qo_indptr.clone() if qo_indptr is not None else None
        self.causal, self.sm_scale, self.dtypes = causal, sm_scale, (q_data_type, kv_data_type)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        PLANS.append(self)

    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False, enable_pdl=None):
        from engine.attention.torch_native import _attend

        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1] == 1 and k_cache.shape[2:] == self.heads[1:] and q.shape[1] == self.heads[0]
        assert (q.dtype, k_cache.dtype) == self.dtypes
        indptr = self.indptr_buf.tolist()
        bs = len(indptr) - 1
        qo = self.qo_indptr.tolist() if self.qo_indptr is not None else list(range(bs + 1))
        out = torch.empty_like(q)
        for i in range(bs):
            pages = self.indices_buf[indptr[i]:indptr[i + 1]].long()
            n = qo[i + 1] - qo[i]
            if n:
                prefix = len(pages) - n if self.causal else len(pages)
                out[qo[i]:qo[i + 1]] = _attend(q[qo[i]:qo[i + 1]], k_cache[pages, 0], v_cache[pages, 0],
                                               prefix, self.sm_scale).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.indptr_buf, self.indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_buf = paged_kv_last_page_len_buffer
        if use_cuda_graph:
            assert len(self.indptr_buf) == len(self.last_buf) + 1

    @property
    def is_cuda_graph_enabled(self):
        return self.graph

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv=False):
        self._store(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                    page_size, False, sm_scale, q_data_type, kv_data_type, seq_lens)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None):
        assert kv_layout == "NHD" and not use_cuda_graph
        self.graph = False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
             block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
             fixed_split_size=None, disable_split_kv=False):
        _host_int32(qo_indptr, "qo_indptr")
        assert causal
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                    num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                    q_data_type, kv_data_type, seq_lens)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    if not CPU:
        pytest.skip("the stand-in runs on CPU-only machines (tests/gpu has the real one)")
    triton = pytest.importorskip("triton")
    if type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    import engine.attention.flashinfer as backend_module

    monkeypatch.setattr(backend_module, "_check", lambda dtype, device: None)  # float32, CPU
    PLANS.clear()
    return backend_module


LENS = [37, 65, 34, 80, 50]
MIXED = [(0, 0, 37), (1, 20, 45), (2, 33, 1), (3, 64, 16), (4, 7, 30), (0, 36, 0)]
DECODE = [(s, n - 1, 1) for s, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def scene():
    from engine.testing.attention_scene import AttentionScene

    return AttentionScene(LENS)


def assert_close_to_torch(scene, backend, items, decode=False, got=None):
    from engine.attention.torch_native import TorchNativeAttentionBackend

    got = got if got is not None else scene.run(backend, items, decode)
    ref = scene.run(TorchNativeAttentionBackend(), items, decode)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and torch.allclose(g, r, rtol=0, atol=1e-5)


def test_extend_and_decode_match_torch_with_one_plan_per_batch(fake_flashinfer, scene):
    backend = create_attention_backend("flashinfer")
    assert_close_to_torch(scene, backend, MIXED)
    assert_close_to_torch(scene, backend, DECODE, decode=True)
    assert len(PLANS) == 2  # one per batch
    fb = scene.batch(backend, DECODE, decode=True)
    backend.init_forward_metadata(fb)
    for _ in range(3):  # more layers of the same batch: no new plan
        scene.forward(backend, DECODE, fb)
    assert len(PLANS) == 3
    assert PLANS[-1].dtypes == (torch.float32, torch.float32) and PLANS[-1].heads == (4, 2, 16)


def test_graph_capture_and_replay_with_padding(fake_flashinfer, scene):
    """Capture at bs 8 (3 rows + 5 padding rows), replay at other lengths: the replay plans from
    the host lengths it is given, the layer calls never plan, and the rows equal eager's."""
    backend = create_attention_backend("flashinfer")
    backend.init_cuda_graph_state(8, max(LENS) + 1, 4, 2, 16, torch.device("cpu"))
    for step, items in enumerate(([(s, n - 9, 1) for s, n in enumerate(LENS[:3])], DECODE[2:])):
        fb = scene.batch(backend, items, decode=True)
        pad = 8 - len(items)
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
        fb.seq_lens = torch.cat([fb.seq_lens, torch.ones(pad, dtype=torch.int64)])
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
        q_pad = [(0, 0, 1)] * pad  # padding rows: any q, written to slot 0 and dropped
        if step == 0:
            backend.init_forward_metadata_capture(8, fb.req_pool_indices, fb.seq_lens)
            scene.forward(backend, items + q_pad, fb)  # the warm-up plans (at its first layer)
        plans = len(PLANS)
        backend.init_forward_metadata_replay(8, fb.req_pool_indices, fb.seq_lens,
                                             fb.seq_lens_cpu + [1] * pad)
        assert len(PLANS) == plans + 1
        got = scene.forward(backend, items + q_pad, fb)[:len(items)]  # what the graph re-runs
        assert len(PLANS) == plans + 1
        assert_close_to_torch(scene, backend, items, decode=True, got=got)
