"""The trainer's Triton path at small sizes: PackedAttention("triton") and the autograd wrappers.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1); with CUDA they run
compiled. Checked: PackedAttention's rows for a packed batch are bitwise the rows the engine's
deterministic TritonAttentionBackend gives the same positions through a KV pool, prefilled in
chunks among other sequences and decoded (merged in the program or by stage 2); its default
split size is the backend's; a Policy with Triton attention recomputes an engine's rollout
logprobs bitwise; and the autograd.Functions (Triton forward, torch backward) give torch's
gradients. Float32 only: the interpreter's tl.dot on bf16 operands does not compute a product
(bf16 rows come out as garbage in the engine's kernels and here alike). Skipped where Triton is
not installed (CI).
"""

from __future__ import annotations


import pytest
import torch

from engine.testing.triton_for_tests import import_triton_or_skip

DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton = import_triton_or_skip()

from engine.attention.deterministic import split_kv_attention  # noqa: E402
from engine.attention.triton import TritonAttentionBackend  # noqa: E402
from engine.kernels.batch_invariant import autograd as bi_autograd  # noqa: E402
from engine.kernels.batch_invariant import ops, triton_ops  # noqa: E402
from engine.testing.attention_scene import AttentionScene  # noqa: E402
from trainer_bridge.packed_attention import PackedAttention, PackedBatch, causal_attention  # noqa: E402


def packed_rows(scene: AttentionScene, attention: PackedAttention) -> list[torch.Tensor]:
    """PackedAttention over every sequence of the scene, whole, packed in one batch."""
    q, k, v = (torch.cat(t) for t in (scene.q, scene.k, scene.v))
    out = attention.forward(q, k, v, 0, scene.head_dim**-0.5, PackedBatch(scene.lens, attention))
    return list(out.split(scene.lens))


def engine_rows(scene: AttentionScene, split: int, chunk: int, decoded: int, num_sms: int
                ) -> list[torch.Tensor]:
    """The engine's deterministic Triton backend over the pool: all sequences prefilled together
    in chunks of `chunk` tokens, then their last `decoded` positions decoded, one step at a time."""
    backend = TritonAttentionBackend(deterministic=True, split_size=split, num_sms=num_sms)
    rows: list[list[torch.Tensor]] = [[] for _ in scene.lens]
    ends = [n - decoded for n in scene.lens]
    for start in range(0, max(ends), chunk):
        items = [(s, start, min(chunk, end - start)) for s, end in enumerate(ends) if start < end]
        for (s, *_), out in zip(items, scene.run(backend, items)):
            rows[s].append(out)
    for step in range(decoded):
        items = [(s, end + step, 1) for s, end in enumerate(ends)]
        for (s, *_), out in zip(items, scene.run(backend, items, decode=True)):
            rows[s].append(out)
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32)], ids=["g2", "g3"])
@pytest.mark.parametrize("num_sms", [1, 64], ids=["merge", "partials"])
def test_packed_equals_engine_prefill_and_decode(heads, kv_heads, head_dim, num_sms):
    scene = AttentionScene([37, 70, 21], heads, kv_heads, head_dim, device=DEV, seed=3)
    split = 16
    packed = packed_rows(scene, PackedAttention("triton", split))
    for got, ref in zip(packed, engine_rows(scene, split, chunk=24, decoded=4, num_sms=num_sms)):
        assert torch.equal(got, ref)
    # and it is attention: close to the torch oracle
    for s, got in enumerate(packed):
        n = scene.lens[s]
        ref = split_kv_attention(scene.q[s], scene.k[s], scene.v[s], torch.arange(n, device=DEV),
                                 head_dim**-0.5, split)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_default_split_is_the_engine_backends():
    """No split size given on either side: 256-key splits, crossed by the long sequence."""
    scene = AttentionScene([300, 19], device=DEV, seed=4)
    attention = PackedAttention("triton")
    assert attention.split_size(torch.device(DEV)) == TritonAttentionBackend(deterministic=True).split_size == 256
    packed = packed_rows(scene, attention)
    backend = TritonAttentionBackend(deterministic=True, num_sms=64)
    extend = scene.run(backend, [(0, 0, 270), (1, 0, 17)])
    decode = [scene.run(backend, [(0, p, 1), (1, 17 + i, 1)], decode=True) for i, p in enumerate((270, 271))]
    assert torch.equal(packed[0][:270], extend[0]) and torch.equal(packed[1][:17], extend[1])
    for i, (a, b) in enumerate(decode):
        assert torch.equal(packed[0][270 + i], a[0]) and torch.equal(packed[1][17 + i], b[0])


def test_default_backend_follows_the_device():
    assert PackedAttention().kernel(torch.device("cpu")) == "torch"
    assert PackedAttention().split_size(torch.device("cpu")) == 64
    assert PackedAttention().kernel(torch.device("cuda")) == "triton"
    assert PackedAttention("torch").kernel(torch.device("cuda")) == "torch"
    with pytest.raises(ValueError):
        PackedAttention("flash")


def _leaf(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype).requires_grad_()


def _grads(fn, inputs, seed=99):
    """Gradients of a random linear function of fn(*inputs)'s outputs."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(DEV)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, inputs)


def _assert_grads_close(got, ref, tol=1e-5):
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_attention_gradients():
    lens = [37, 20, 45]
    q, k, v = _leaf(sum(lens), 6, 32, seed=1), _leaf(sum(lens), 2, 32, seed=2), _leaf(sum(lens), 2, 32, seed=3)
    attention = PackedAttention("triton", 16)
    (out,), got = _grads(lambda *a: attention.forward(*a, 0, 32**-0.5, PackedBatch(lens, attention)), (q, k, v))
    assert out.grad_fn is not None
    # the torch split-KV function, differentiable end to end, as the reference
    def ref_fn(q, k, v):
        starts = [sum(lens[:i]) for i in range(len(lens))]
        return torch.cat([split_kv_attention(q[a:a + n], k[a:a + n], v[a:a + n], torch.arange(n, device=DEV),
                                             32**-0.5, 16) for a, n in zip(starts, lens)])
    (ref_out,), ref = _grads(ref_fn, (q, k, v))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-4)
    _assert_grads_close(got, ref, 1e-4)
    # only what needs a gradient gets one
    q2 = q.detach().requires_grad_()
    out = attention.forward(q2, k.detach(), v.detach(), 0, 32**-0.5, PackedBatch(lens, attention))
    (gq,) = torch.autograd.grad(out.sum(), (q2,))
    torch.testing.assert_close(gq, torch.autograd.grad(
        causal_attention(q2, k.detach(), v.detach(), lens, 32**-0.5).sum(), (q2,))[0])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_gradients(bias):
    x, w = _leaf(2, 9, 40, seed=1), _leaf(24, 40, seed=2, scale=0.2)
    b = _leaf(24, seed=3) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    out, got = _grads(lambda x, w, b=None: bi_autograd.bi_linear(x, w, b), inputs)
    assert torch.equal(out[0], triton_ops.bi_linear(x.detach(), w.detach(), b.detach() if bias else None))
    _, ref = _grads(lambda x, w, b=None: torch.nn.functional.linear(x, w, b), inputs)
    _assert_grads_close(got, ref)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_rms_norm_gradients(residual):
    x, w = _leaf(11, 48, seed=1), _leaf(48, seed=2, scale=0.3)
    inputs = (x, w, _leaf(11, 48, seed=3)) if residual else (x, w)
    out, got = _grads(lambda x, w, r=None: bi_autograd.bi_rms_norm(x, w, 1e-6, r), inputs)
    tri = triton_ops.bi_rms_norm(*(t.detach() for t in inputs[:2]), 1e-6, *(t.detach() for t in inputs[2:]))
    for a, b in zip(out, tri if residual else (tri,)):
        assert torch.equal(a, b)
    _, ref = _grads(lambda x, w, r=None: ops.rms_norm_reference(x, w, 1e-6, r), inputs)
    _assert_grads_close(got, ref)
    if residual:  # the last layer's residual output goes unused: no gradient through it
        r = inputs[2]
        normed, _ = bi_autograd.bi_rms_norm(x, w, 1e-6, r)
        got = torch.autograd.grad(normed.sum(), (x, r))
        ref = torch.autograd.grad(ops.rms_norm_reference(x, w, 1e-6, r)[0].sum(), (x, r))
        _assert_grads_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_softmax_gradients(dtype):
    x = _leaf(7, 300, seed=1, scale=3.0, dtype=dtype)
    out, got = _grads(bi_autograd.bi_log_softmax, (x,))
    assert out[0].dtype == torch.float32 and got[0].dtype == dtype
    assert torch.equal(out[0], triton_ops.bi_log_softmax(x.detach()))
    _, ref = _grads(lambda x: torch.log_softmax(x.float(), -1), (x,))
    _assert_grads_close(got, ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(DEV != "cuda", reason="ops sends only CUDA tensors to the Triton kernels")
def test_ops_use_the_wrappers_only_when_grad_is_needed():
    x, w = _leaf(5, 64, seed=1), _leaf(32, 64, seed=2)
    assert type(ops.linear(x, w).grad_fn).__name__ == "_LinearBackward"
    assert type(ops.log_softmax(x).grad_fn).__name__ == "_LogSoftmaxBackward"
    assert type(ops.rms_norm(x, w[0], 1e-6).grad_fn).__name__ == "_RMSNormBackward"
    with torch.no_grad():
        assert torch.equal(ops.linear(x, w), triton_ops.bi_linear(x.detach(), w.detach()))
    assert ops.linear(x.detach(), w.detach()).grad_fn is None


# ---- end to end: a CPU engine with Triton attention, and a Policy with Triton attention ---------
@pytest.mark.skipif(DEV != "cpu", reason="tests/gpu/test_policy_parity_gpu.py covers CUDA")
def test_policy_with_triton_attention_recomputes_rollout_logprobs(engine_factory, tiny_model_dir):
    from tests.engine.conftest import random_prompts
    from trainer_bridge.policy import Policy

    eng = engine_factory(enable_deterministic_inference=True, attention_backend="triton",
                         chunked_prefill_size=48)
    prompts = random_prompts(3, eng.local_core.parts.vocab_size, lengths=(20, 90), seed=8)
    params = [{"max_new_tokens": 6, "temperature": t, "sampling_seed": i, "ignore_eos": True}
              for i, t in enumerate((0.0, 1.0, 1.0))]
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    policy = Policy.from_pretrained(tiny_model_dir, attention_backend="triton")
    ours = policy.rollout_logprobs(prompts, [o["output_ids"] for o in outs])
    for out, lp in zip(outs, ours):
        ref = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        assert torch.equal(lp.detach().double(), ref)
    ours[0].sum().backward()
    grad = policy.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
