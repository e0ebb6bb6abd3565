"""The trainer's kernels on the GPU: VarlenAttention (normal mode) is flash varlen in bf16 and
agrees with a float64 reference, forward and backward; LigerOps' norms, SwiGLU and q/k norm + rope
agree with the torch code (TorchOps) in float32, forward and backward; deterministic mode's float32 backward
(batched, padded SDPA) gives the same gradients run after run; a normal-mode Policy's logprobs and
gradients agree with deterministic mode's to bf16 rounding."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

LENS = [300, 17, 290, 1, 120, 250, 5, 64]


def reference(q, k, v, lens, scale):
    group = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.double().split(lens), k.double().split(lens), v.double().split(lens)):
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        n = qs.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(outs)


def test_varlen_attention_is_flash_and_matches_float64(monkeypatch):
    from trainer_bridge import varlen_attention
    from trainer_bridge.packed_attention import PackedBatch

    def no_fallback(*args, **kwargs):
        raise AssertionError("bf16 on CUDA should take flash varlen, not the padded fallback")

    monkeypatch.setattr(varlen_attention, "causal_attention", no_fallback)
    gen = torch.Generator(device="cuda").manual_seed(0)
    total, scale = sum(LENS), 128**-0.5
    q, k, v = (torch.randn(total, h, 128, device="cuda", generator=gen).bfloat16().requires_grad_(True)
               for h in (16, 8, 8))
    batch = PackedBatch(list(LENS), varlen_attention.VarlenAttention())
    out = batch.attn_backend.forward(q, k, v, 0, scale, batch)
    weight = torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = reference(qd, kd, vd, LENS, scale)
    want_grads = torch.autograd.grad((want * weight).sum(), (qd, kd, vd))
    assert (out.double() - want).abs().max() / want.abs().max() < 2e-2
    for got, ref in zip(grads, want_grads):
        assert (got.double() - ref).abs().max() / ref.abs().max() < 3e-2


def _check_op(op_name: str, make_inputs, tol: float = 2e-2, differentiated: int = 99):
    """LigerOps.op on bf16 inputs vs TorchOps.op on their float32 copies: outputs and the
    gradients of the first `differentiated` tensor inputs."""
    from engine.models.layers import TorchOps
    from trainer_bridge.liger_ops import LigerOps

    inputs = make_inputs()
    grad = [torch.is_tensor(t) and t.is_floating_point() and i < differentiated for i, t in enumerate(inputs)]
    ours = [t.bfloat16().requires_grad_(True) if g else t for t, g in zip(inputs, grad)]
    ref = [t.float().requires_grad_(True) if g else t for t, g in zip(inputs, grad)]
    got = getattr(LigerOps(), op_name)(*ours)
    want = getattr(TorchOps(), op_name)(*ref)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    gen = torch.Generator(device="cuda").manual_seed(9)
    weights = [torch.randn(w.shape, device="cuda", generator=gen) for w in want]
    grads = torch.autograd.grad(sum((g.float() * w).sum() for g, w in zip(got, weights)),
                                [t for t, g in zip(ours, grad) if g])
    want_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(want, weights)),
                                     [t for t, g in zip(ref, grad) if g])
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        assert (g.float() - w).abs().max() / w.abs().max() < tol, op_name
    for g, w in zip(grads, want_grads):
        assert (g.float() - w).abs().max() / w.abs().max() < tol, op_name


def _randn(*shape, seed=0):
    return torch.randn(*shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))


def test_liger_rms_norm_with_and_without_the_residual():
    _check_op("rms_norm", lambda: (_randn(300, 1024), 1 + 0.1 * _randn(1024, seed=1), 1e-6))
    _check_op("rms_norm", lambda: (_randn(300, 1024), 1 + 0.1 * _randn(1024, seed=1), 1e-6, _randn(300, 1024, seed=2)))


def test_liger_silu_and_mul_on_the_fused_gate_up_output():
    _check_op("silu_and_mul", lambda: (_randn(300, 2 * 3072),))


def test_liger_qk_norm_rope_on_views_of_the_qkv_output():
    from engine.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(128, 1e6).to("cuda")
    cos, sin = rope(torch.arange(300, device="cuda") % 97)

    def inputs():  # q and k as strided views of one qkv row, as the attention layer makes them
        qkv = _randn(300, (16 + 8 + 8) * 128)
        q, k = qkv[:, :2048].view(300, 16, 128), qkv[:, 2048:3072].view(300, 8, 128)
        return q, k, cos, sin

    _check_op("qk_norm_rope", inputs, differentiated=2)  # rope's cos / sin are constants

    def with_norm():
        q, k, c, s = inputs()
        return q, k, c, s, (1 + 0.1 * _randn(128, seed=3), 1 + 0.1 * _randn(128, seed=4), 1e-6)

    from engine.models.layers import TorchOps
    from trainer_bridge.liger_ops import LigerOps
    q, k, c, s, norm = with_norm()
    got = LigerOps().qk_norm_rope(q.bfloat16(), k.bfloat16(), c, s, tuple(t.bfloat16() if torch.is_tensor(t) else t for t in norm))
    want = TorchOps().qk_norm_rope(q, k, c, s, norm)
    for g, w in zip(got, want):
        assert (g.float() - w).abs().max() / w.abs().max() < 2e-2


def test_a_normal_mode_policy_on_cuda_takes_liger():
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.liger_ops import LigerOps
    from trainer_bridge.policy import Policy

    policy = Policy.from_pretrained(str(tiny_model_path()), dtype=torch.bfloat16, device="cuda", batch_invariant=False)
    norms = [m for m in policy.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(isinstance(m.autograd_ops, LigerOps) for m in norms)


@pytest.fixture(scope="module")
def batch():
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.policy import Policy

    path = str(tiny_model_path())
    vocab = Policy.from_pretrained(path, dtype=torch.bfloat16, device="cuda").model.config.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 7, 300, 90)]
    responses = [[rng.randrange(3, vocab) for _ in range(n)] for n in (60, 200, 30, 1)]
    return path, prompts, responses


def _logprobs_and_grads(policy, prompts, responses):
    policy.zero_grad(set_to_none=True)
    lps = torch.cat(policy.rollout_logprobs(prompts, responses))
    lps.sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    return lps.detach().double(), grads


def test_deterministic_gradients_repeat_bit_for_bit(batch):
    from trainer_bridge.policy import Policy

    path, prompts, responses = batch
    policy = Policy.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    lps1, grads1 = _logprobs_and_grads(policy, prompts, responses)
    lps2, grads2 = _logprobs_and_grads(policy, prompts, responses)
    assert torch.equal(lps1, lps2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name


def test_normal_mode_agrees_with_deterministic_mode(batch):
    from trainer_bridge.policy import Policy

    path, prompts, responses = batch
    exact = Policy.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
    normal = Policy.from_pretrained(path, dtype=torch.bfloat16, device="cuda", batch_invariant=False)
    want, want_grads = _logprobs_and_grads(exact, prompts, responses)
    got, got_grads = _logprobs_and_grads(normal, prompts, responses)
    # bf16 activations and other kernels: a bf16 ulp at these |logprob| ~ 8-16 is 0.0625
    assert (got - want).abs().max() < 0.25 and (got - want).abs().mean() < 0.05
    for name, ref in want_grads.items():
        cos = torch.nn.functional.cosine_similarity(got_grads[name].flatten(), ref.flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["normal", "deterministic"])
def test_a_micro_batch_never_makes_the_host_wait(batch, batch_invariant):
    """Forward, RL loss and backward of a micro batch queue without one host-device sync (a
    pageable copy, .item(), a blocking transfer): the host prepares the next micro batch while
    the device runs this one. The second pass is checked; the first compiles the kernels."""
    from trainer_bridge.losses import LossConfig, rl_objective
    from trainer_bridge.policy import Policy
    from trainer_bridge.rollout_batch import RolloutBatch

    path, prompts, responses = batch
    policy = Policy.from_pretrained(path, dtype=torch.bfloat16, device="cuda", batch_invariant=batch_invariant)
    micro = RolloutBatch(prompts, responses, [[1] * len(r) for r in responses],
                         [[-1.0] * len(r) for r in responses], [0.5, -0.5, 1.0, -1.0])
    for check in (False, True):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            loss, metrics = rl_objective(policy.rollout_logprobs(micro.prompts, micro.responses), micro, LossConfig())
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and float(metrics["logprob_abs_diff_max"]) > 0
    assert all(p.grad is not None for p in policy.parameters())
