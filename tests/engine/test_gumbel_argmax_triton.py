"""The fused Gumbel-argmax Triton kernel under Triton's CPU interpreter, against the torch reference.

The interpreter has no libdevice and takes numpy's log, which may differ from torch's CPU log in
the last bit, so tokens are compared (random logprobs leave no near-ties at 1e-15), also on
all-zero logprobs, where the hash alone decides the token. Against CUDA's log on the GPU:
tests/gpu/test_sampler_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter flag would leak into the GPU tests' kernels
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
triton = pytest.importorskip("triton")
if type(triton.language.standard.cdiv).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from engine.kernels.gumbel_argmax import gumbel_argmax_triton  # noqa: E402
from engine.sampling.seeds import gumbel_argmax, to_int64  # noqa: E402


def _rows(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.tensor([to_int64(s) for s in torch.randint(0, 2**62, (B,), generator=g).tolist()])
    seeds[0] = to_int64(2**64 - 5)  # a seed above 2^63: negative as int64
    positions = torch.randint(0, 1 << 40, (B,), generator=g)
    return seeds, positions


@pytest.mark.parametrize("vocab,chunk", [(3000, 8192), (5000, 1024), (4099, 512)],
                         ids=["one-chunk", "five-chunks", "ragged-chunks"])
def test_tokens_equal_the_torch_reference(vocab, chunk):
    B = 6
    seeds, positions = _rows(B, seed=vocab)
    logprobs = torch.log_softmax(torch.randn(B, vocab, generator=torch.Generator().manual_seed(1)) * 3, -1)
    logprobs[1, : vocab // 2] = float("-inf")  # masked (top-k / top-p) entries never win
    logprobs[2, :] = float("-inf")
    logprobs[2, vocab - 1] = 0.0  # one allowed token, in the last chunk
    got = gumbel_argmax_triton(logprobs, seeds, positions, chunk=chunk)
    assert torch.equal(got, gumbel_argmax(logprobs, seeds, positions))
    assert got[1] >= vocab // 2 and got[2] == vocab - 1


def test_pure_noise_and_batch_of_one():
    seeds, positions = _rows(4, seed=9)
    flat = torch.zeros(4, 2000)
    assert torch.equal(gumbel_argmax_triton(flat, seeds, positions, chunk=512),
                       gumbel_argmax(flat, seeds, positions))
    one = gumbel_argmax_triton(flat[2:3], seeds[2:3], positions[2:3], chunk=512)
    assert one.tolist() == gumbel_argmax(flat, seeds, positions)[2:3].tolist()
    assert gumbel_argmax_triton(flat[:0], seeds[:0], positions[:0]).shape == (0,)
