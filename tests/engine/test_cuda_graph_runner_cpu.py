"""CudaGraphRunner's static buffers, padding and replay metadata, on the CPU.

Real capture needs CUDA (tests/gpu/test_cuda_graph.py); here each "graph" re-runs the captured
closure on replay, writing into the captured output like a graph would, so everything else the
runner does (batch-size buckets, padding rows, the backend's capture/replay metadata, the
ModelRunner hook) runs for real, under Triton's interpreter on the tiny model.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
pytest.importorskip("triton")

from engine.runner.cuda_graph import CudaGraphRunner, capture_batch_sizes  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402


class _EagerGraph:
    def __init__(self, run):
        self.replay = run


class EagerGraphRunner(CudaGraphRunner):
    def _capture_all(self) -> None:
        for bs in self.capture_bs:
            fb = self._static_batch(bs)
            self.attn_backend.init_forward_metadata_capture(bs, fb.req_pool_indices, fb.seq_lens)
            self.graphs[bs] = _EagerGraph(lambda fb=fb: self._forward(fb))


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    big = capture_batch_sizes(512)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-3:] == [480, 496, 512] and len(big) == 51
    assert capture_batch_sizes(300)[-4:] == [256, 272, 288, 300]


@pytest.mark.parametrize("dtype,logits", [("float32", "float32"), ("bfloat16", "model"), ("bfloat16", "float32")])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "normal"])
def test_replayed_decode_equals_eager(engine_factory, deterministic, dtype, logits, monkeypatch):
    """model: the graphs' logits in the model's dtype (bf16), which the LM head's GEMM writes."""
    monkeypatch.setenv("TANDEM_GRAPH_LOGITS", logits)
    eng = engine_factory(attention_backend="triton", enable_deterministic_inference=deterministic, dtype=dtype)
    prompts = random_prompts(5, eng.local_core.parts.vocab_size, lengths=(3, 40), seed=3)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    runs = []
    for graphs in (False, True):
        runner = eng.local_core.parts.runner
        runner.cuda_graph = (EagerGraphRunner(runner.model, runner.attn_backend, runner.kv_pool,
                                              runner.req_to_token, runner.device, max_bs=8)
                             if graphs else None)
        outs = [eng.generate(input_ids=prompts[:n], sampling_params=params, return_logprob=True)
                for n in (1, 3, 5)]  # bs 3 and 5 replay padded graphs of 4 and 8
        runs.append([o for batch in outs for o in batch])
        if graphs:
            assert runner.cuda_graph.num_replays == 3 * 4
            assert runner.cuda_graph.logits.dtype == (torch.bfloat16 if logits == "model" else torch.float32)
            runner.cuda_graph = None
    eager, replayed = runs
    assert [o["output_ids"] for o in replayed] == [o["output_ids"] for o in eager]
    for a, b in zip(replayed, eager):
        lp_a = [lp for lp, *_ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        if deterministic:
            assert lp_a == lp_b
        else:
            assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= 1e-5
    eng.check_integrity()


def test_linear_forward_into_writes_its_output_where_told(monkeypatch):
    """forward_into: cuBLAS-shaped (bias-free, normal mode, no small-M kernel) in out's dtype the
    GEMM writes `out` itself (no temporary: `self(x)` is not called), else the output is copied
    (and cast) there; the same values."""
    from engine.models.layers import Linear
    from engine.runner.cuda_graph import logits_dtype

    torch.manual_seed(0)
    x = torch.randn(5, 16).bfloat16()
    for bias, det in ((False, False), (True, False), (False, True)):
        lin = Linear(16, 40, bias=bias, deterministic=det).bfloat16()
        want = lin(x)
        assert lin._cublas_output(x) == (not bias and not det)
        for dtype in (torch.bfloat16, torch.float32):
            for grad in (False, True):  # recorded by autograd: the copy (out= takes no gradient)
                out = torch.full((8, 40), float("nan"), dtype=dtype)
                direct = dtype == torch.bfloat16 and not grad and lin._cublas_output(x)
                calls = []
                monkeypatch.setattr(lin, "forward", lambda *a, _f=lin.forward: calls.append(1) or _f(*a))
                with torch.set_grad_enabled(grad):
                    got = lin.forward_into(x, out[:5])
                monkeypatch.undo()
                assert calls == ([] if direct else [1])
                assert got.data_ptr() == out.data_ptr() and torch.equal(got, want.to(dtype))
                assert out[5:].isnan().all()
    model = torch.nn.Module()
    model.lm_head = Linear(16, 40, bias=False).bfloat16()
    monkeypatch.delenv("TANDEM_GRAPH_LOGITS", raising=False)
    assert logits_dtype(model) == torch.bfloat16  # the default: the LM head's
    monkeypatch.setenv("TANDEM_GRAPH_LOGITS", "float32")
    assert logits_dtype(model) == torch.float32
    monkeypatch.setenv("TANDEM_GRAPH_LOGITS", "half")
    with pytest.raises(ValueError, match="TANDEM_GRAPH_LOGITS"):
        logits_dtype(model)
