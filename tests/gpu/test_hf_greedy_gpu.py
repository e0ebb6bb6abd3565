"""Greedy output of the tiny model on the GPU in float32 equals HF transformers' on the GPU.

The oracle is HF `generate` on the same checkpoint, one prompt at a time (no padding), TF32 off.
tandem runs every prompt in one batch, with the radix cache on, prompts that share prefixes
(so later ones extend cached tokens), a small chunked-prefill size (so long prompts are cut)
and CUDA-graph decode; float32 keeps near-ties out of the way, so tokens must be identical.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

MAX_NEW = 24


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def tiny(request, tmp_path_factory) -> str:
    """The dense tiny model, and the tiny Qwen3-MoE (its experts in the Triton fused-MoE kernel)."""
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, preset=request.param))


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny).vocab_size
    rng = random.Random(0)
    base = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 200))] for _ in range(12)]
    shared = [p[: len(p) // 2] + [rng.randrange(3, vocab) for _ in range(5)] for p in base[:6]]
    return base + shared


@pytest.fixture(scope="module")
def hf_outputs(tiny, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return outs


@pytest.mark.parametrize("backend,deterministic", [("triton", False), ("triton", True), ("torch", False)],
                         ids=["triton", "triton-det", "torch"])
def test_greedy_equals_hf_in_float32(tiny, prompts, hf_outputs, backend, deterministic):
    from engine import Engine

    eng = Engine(model_path=tiny, device="cuda", dtype="float32", attention_backend=backend,
                 enable_deterministic_inference=deterministic, chunked_prefill_size=64,
                 cuda_graph_max_bs=32, max_total_tokens=16384)
    try:
        # min_new_tokens bans EOS as HF's does (ignore_eos alone would let EOS be picked)
        params = {"max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "temperature": 0.0,
                  "ignore_eos": True}
        first = eng.generate(input_ids=prompts[:12], sampling_params=params)
        again = eng.generate(input_ids=prompts[12:], sampling_params=params)  # extend cached prefixes
        outs = [o["output_ids"] for o in first + again]
        cached = sum(o["meta_info"]["cached_tokens"] for o in again)
        graphs = eng.local_core.parts.runner.cuda_graph
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()
    assert cached > 0, "the shared-prefix prompts never hit the radix cache"
    if backend == "triton":
        assert graphs is not None and graphs.num_replays > 0
    mismatched = [i for i, (a, b) in enumerate(zip(outs, hf_outputs)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from HF, first: {outs[mismatched[0]]} vs " \
                           f"{hf_outputs[mismatched[0]]}"
