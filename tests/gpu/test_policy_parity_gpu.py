"""True on-policy on the GPU (DESIGN section 4, property 5): the trainer's Policy recomputes, bit
for bit, the rollout logprobs of an engine started with --enable-deterministic-inference, in bf16,
with the engine's default CUDA attention (Triton split-KV, 256-key splits), chunked prefill and
CUDA-graph decode; and a backward pass through the Triton kernels' autograd wrappers gives every
parameter a finite, non-zero gradient.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.testing.triton_for_tests import import_compiled_triton_or_skip

pytestmark = pytest.mark.gpu
triton = import_compiled_triton_or_skip()

MAX_NEW = 40
# prompts past 256 tokens cross a key split in prefill, others only while decoding or never
PROMPT_LENS = [300, 17, 290, 120, 250, 5]


def logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)


@pytest.fixture(scope="module")
def model_path() -> str:
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path())


@pytest.fixture(scope="module")
def rollouts(model_path):
    """(prompts, engine outputs): greedy and seeded temperature-1 requests in one batch."""
    from engine import Engine

    eng = Engine(model_path=model_path, device="cuda", dtype="bfloat16", enable_deterministic_inference=True,
                 chunked_prefill_size=128, max_total_tokens=32768)
    try:
        vocab = eng.local_core.parts.vocab_size
        rng = random.Random(11)
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
        params = [{"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 1.0 if i % 2 else 0.0,
                   "sampling_seed": 1000 + i} for i in range(len(prompts))]
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        eng.check_integrity()
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()
    assert all(len(o["output_ids"]) == MAX_NEW for o in outs)
    return prompts, outs


@pytest.fixture(scope="module")
def policy(model_path):
    from trainer_bridge.policy import Policy

    return Policy.from_pretrained(model_path, dtype=torch.bfloat16, device="cuda")


def assert_bitwise(ours: list[torch.Tensor], outs: list[dict]) -> None:
    for i, (lp, out) in enumerate(zip(ours, outs)):
        got, ref = lp.detach().double().cpu(), logprobs(out)
        if not torch.equal(got, ref):
            bad = (got != ref).nonzero().flatten().tolist()
            pytest.fail(f"rollout {i} (prompt {PROMPT_LENS[i]} tokens): {len(bad)} of {len(ref)} logprobs "
                        f"differ, first at response token {bad[0]}, max |diff| {(got - ref).abs().max():.3g}")


def test_policy_uses_the_engines_attention(policy):
    assert policy.attention.kernel(torch.device("cuda")) == "triton"
    assert policy.attention.split_size(torch.device("cuda")) == 256


def test_rollout_logprobs_bitwise_with_grad(policy, rollouts):
    """Grad mode on, parameters requiring grad: the autograd wrappers' forward."""
    prompts, outs = rollouts
    ours = policy.rollout_logprobs(prompts, [o["output_ids"] for o in outs])
    assert ours[0].grad_fn is not None
    assert_bitwise(ours, outs)


def test_rollout_logprobs_bitwise_no_grad(policy, rollouts):
    """Under no_grad: the plain Triton kernels, as the engine calls them."""
    prompts, outs = rollouts
    with torch.no_grad():
        ours = policy.rollout_logprobs(prompts, [o["output_ids"] for o in outs])
    assert_bitwise(ours, outs)


def test_backward_gives_every_parameter_a_gradient(policy, rollouts):
    prompts, outs = rollouts
    policy.zero_grad(set_to_none=True)
    lps = policy.rollout_logprobs(prompts[:3], [o["output_ids"] for o in outs[:3]])
    torch.cat(lps).sum().backward()
    params = dict(policy.model.named_parameters())
    assert params
    for name, p in params.items():
        assert p.grad is not None, name
        assert p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    policy.zero_grad(set_to_none=True)
