"""The sampler on CUDA: the fused Gumbel-argmax kernel gives the torch reference's tokens at real
vocabulary size, and it is built at start-up, so a rollout's first sampled step does not wait
for a JIT. Run with -s to see the timings."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

VOCAB = 151936


def _time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


@pytest.mark.parametrize("B", [1, 7, 256])
def test_fused_kernel_tokens_equal_the_reference(B):
    from engine.kernels.gumbel_argmax import gumbel_argmax_triton
    from engine.sampling.seeds import gumbel_argmax, to_int64

    g = torch.Generator(device="cuda").manual_seed(B)
    for trial in range(5):
        logits = torch.randn(B, VOCAB, device="cuda", generator=g) * (1 + trial)
        if trial == 4:  # a top-k style mask: most entries -inf
            logits[:, 1000:] = float("-inf")
        logprobs = torch.log_softmax(logits, -1)
        seeds = torch.tensor([to_int64((trial << 62) + 7919 * i) for i in range(B)], device="cuda")
        positions = torch.arange(B, device="cuda") * 131 + trial
        fused = gumbel_argmax_triton(logprobs, seeds, positions)
        assert torch.equal(fused, gumbel_argmax(logprobs, seeds, positions)), (B, trial)
    t_fused = _time_us(lambda: gumbel_argmax_triton(logprobs, seeds, positions))
    t_ref = _time_us(lambda: gumbel_argmax(logprobs, seeds, positions))
    print(f"  B={B}: fused {t_fused:.0f} us, torch reference {t_ref:.0f} us")


def test_first_sampled_requests_do_not_wait(tmp_path):
    from engine import Engine
    from engine.testing.tiny_model import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tiny", preset="tiny"))
    eng = Engine(model_path=path, device="cuda", cuda_graph_max_bs=8, max_total_tokens=8192)
    try:
        assert eng.core.parts.runner.sampler.warmed, "the sampler was not warmed at start-up"
        params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
        for bs in (1, 3):
            start = time.perf_counter()
            outs = eng.generate(input_ids=[[5, 6, 7, 8]] * bs, sampling_params=params)
            took = time.perf_counter() - start
            print(f"  first sampled bs {bs}: {took * 1e3:.0f} ms")
            assert all(len(o["output_ids"]) == 4 for o in outs)
            assert took < 1.0, f"first sampled request at bs {bs} took {took:.1f} s"
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()
