"""Which kernels the sampler takes: its warm-up (compiles, and the fallbacks when one fails) and
the batches it hands the fused sampling kernel (engine/kernels/gumbel_sample.py) on CUDA. The
kernels' own results: tests/engine/test_sampling.py and the Triton interpreter tests."""

from __future__ import annotations

import torch

from engine.sampling.sampler import Sampler
from engine.sampling.seeds import gumbel_argmax
from engine.sampling_params import SamplingParams
from tests.engine.test_sampling import V, _batch


def test_a_failing_compile_at_warmup_falls_back_to_eager(monkeypatch):
    sampler = Sampler()

    def broken_compiler(device):
        def fn(*args):
            raise RuntimeError("no compiler")
        return fn

    monkeypatch.setattr(sampler, "_gumbel_argmax", broken_compiler)
    sampler.warmup(torch.device("cuda"), vocab_size=10)  # without CUDA the allocation fails first: same path
    assert sampler._compile is False
    monkeypatch.undo()
    assert sampler._gumbel_argmax(torch.device("cuda")) is gumbel_argmax  # eager from now on


def test_sampler_warmup_falls_back_from_the_triton_kernel_to_torch_compile(monkeypatch):
    """TANDEM_TRITON_GUMBEL=1 and a Triton kernel that fails to run (a compile error on the device):
    torch.compile's kernel takes over, not the ~25x slower eager path; if that fails too, eager."""
    from types import SimpleNamespace

    from engine.sampling import sampler as sampler_mod

    kernel = object()
    monkeypatch.setattr(sampler_mod, "_triton_gumbel_argmax", lambda: kernel)
    monkeypatch.setattr(sampler_mod.torch, "compile", lambda fn, dynamic: "compiled")
    monkeypatch.setattr(sampler_mod, "compile_side_by_side", lambda calls: None)
    monkeypatch.setenv("TANDEM_FUSED_SAMPLE", "0")
    tried = []
    for works in ({"torch.compile"}, set()):
        tried.clear()
        monkeypatch.setattr(sampler_mod, "warms", lambda calls, what, instead: tried.append(what) or what in works)
        s = sampler_mod.Sampler()
        s.warmup(SimpleNamespace(type="cuda"), 100)
        assert tried == ["the Triton noise kernel", "torch.compile"]
        assert (s._compile, s._compiled) == ((True, "compiled") if works else (False, None))


def test_sampler_warmup_drops_a_failing_fused_kernel(monkeypatch):
    """The fused sampling kernel warms first, with every logits dtype handed over; one that fails
    leaves the log_softmax path (plain sampled batches too), the noise kernel unaffected."""
    from types import SimpleNamespace

    from engine.sampling import sampler as sampler_mod

    fused = object()
    monkeypatch.setattr(sampler_mod.Sampler, "_fused_kernel", lambda self, device: fused if self._fused_ok else None)
    monkeypatch.setattr(sampler_mod, "_triton_gumbel_argmax", lambda: None)
    monkeypatch.setattr(sampler_mod.torch, "compile", lambda fn, dynamic: "compiled")
    handed = []
    monkeypatch.setattr(sampler_mod, "compile_side_by_side", handed.extend)
    monkeypatch.setattr(sampler_mod, "warms", lambda calls, what, instead: "fused" not in what)
    s = sampler_mod.Sampler()
    s.warmup(SimpleNamespace(type="cuda"), 100, (torch.float32, torch.bfloat16, torch.float32))
    assert len(handed) == 4  # two dtypes, each at T = 1 and tempered
    assert s._fused_ok is False and s._compiled == "compiled"
    assert sampler_mod.Sampler(log_softmax=lambda x: x)._fused_ok is False  # another log_softmax: other bits


def test_plain_sampled_batches_are_the_fused_kernels():
    """Rows sampled at their temperatures and nothing else: the fused kernel's case (on CUDA);
    a greedy row, a penalty, a bias, a min_new_tokens ban, a grammar mask or a truncation is not."""
    assert _batch([SamplingParams(temperature=1.0)] * 2).plain_sampled
    assert _batch([SamplingParams(temperature=1.0), SamplingParams(temperature=0.3)]).plain_sampled
    for other in (SamplingParams(temperature=0.0), SamplingParams(top_p=0.9), SamplingParams(top_k=5),
                  SamplingParams(min_p=0.1), SamplingParams(repetition_penalty=1.2),
                  SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias={"3": 1.0})):
        assert not _batch([SamplingParams(temperature=1.0), other]).plain_sampled, other
    banned = _batch([SamplingParams(min_new_tokens=4)], suppress_ids=[2], output_ids=[1])
    assert banned.suppress_mask is not None and not banned.plain_sampled
    masked = _batch([SamplingParams()])
    masked.grammar_bitmask = torch.zeros(1, 2, dtype=torch.int32)
    assert not masked.plain_sampled


def test_plain_sampled_batches_go_to_the_fused_kernel_as_it_takes_them(monkeypatch):
    """What Sampler.sample hands the fused kernel (stood in for here; the kernel's own tests are
    tests/engine/test_gumbel_sample_triton.py): no temperatures at T = 1, one per row otherwise,
    float32 logits in deterministic mode, the model's dtype in normal mode; other batches and
    fused=False keep the log_softmax path."""
    from engine.kernels import batch_invariant

    calls = []

    def kernel(logits, temperatures, seeds, positions):
        calls.append((logits.dtype, None if temperatures is None else temperatures.tolist()))
        n = logits.shape[0]
        return torch.zeros(n, dtype=torch.int64), torch.zeros(n), torch.zeros(n)

    monkeypatch.setattr(Sampler, "_fused_kernel", lambda self, device: kernel)
    logits = torch.randn(2, V).to(torch.bfloat16)
    Sampler().sample(logits, _batch([SamplingParams(temperature=1.0)] * 2))
    Sampler().sample(logits, _batch([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]))
    Sampler(log_softmax=batch_invariant.log_softmax).sample(logits, _batch([SamplingParams(temperature=1.0)] * 2))
    assert calls == [(torch.bfloat16, None), (torch.bfloat16, [1.0, 0.5]), (torch.float32, None)]
    Sampler().sample(logits, _batch([SamplingParams(temperature=1.0), SamplingParams(top_p=0.5)]))
    Sampler().sample(logits, _batch([SamplingParams(temperature=1.0)] * 2), fused=False)
    assert len(calls) == 3
