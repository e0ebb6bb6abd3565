"""Structured output on the GPU: the grammar mask with CUDA graphs and the overlap scheduler.

A constrained row's forward runs ahead like a free row's; its sampling (the mask needs the real
token) is launched after the previous step is committed. Every constrained output matches its
regex and equals the plain loop's.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("xgrammar")

CODE = "[0-9]{3}-[a-z]{2}"
GATED: dict[str, bool] = {}  # backend -> whether its masks went through a StreamGate
MASKS: dict[str, str] = {}  # backend -> the class that made its masks


def run(model_path: str, overlap: bool, constrained: bool, backend: str = "thread") -> tuple[list[dict], int]:
    from engine import Engine

    eng = Engine(model_path=model_path, device="cuda", dtype="float32", enable_deterministic_inference=True,
                 disable_overlap_schedule=not overlap, cuda_graph_max_bs=64, max_total_tokens=32768,
                 grammar_backend=backend)
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 100))] for _ in range(48)]
        grammar = {"regex": CODE} if constrained else {"ignore_eos": True}
        params = [{"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": i, **grammar} for i in range(48)]
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        eng.check_integrity()
        GATED[backend] = getattr(eng.local_core.runner.grammar_masks, "gate", None) is not None
        MASKS[backend] = type(eng.local_core.runner.grammar_masks).__name__
        return outs, eng.local_core.stats.num_lookahead_steps
    finally:
        eng.shutdown()
        torch.cuda.empty_cache()


def test_grammar_with_overlap_and_cuda_graphs():
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    plain, _ = run(path, overlap=False, constrained=True)
    over, ahead = run(path, overlap=True, constrained=True)
    assert ahead > 0  # forwards launched before the previous token was read back (outputs are short)
    assert all(re.fullmatch(CODE, o["text"]) for o in over), [o["text"] for o in over]
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]


def test_the_grammar_process_backend_equals_the_thread_backend_with_its_gate():
    """Matchers in their own process, masks through page-locked shared memory, the device waiting
    on the shared gate word (engine/grammar/matcher_client.py): the same tokens as the thread
    backend's plain loop. It is the default ("auto") on a GPU."""
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    plain, _ = run(path, overlap=False, constrained=True)
    over, ahead = run(path, overlap=True, constrained=True, backend="auto")
    assert ahead > 0 and GATED["auto"] and MASKS["auto"] == "MatcherClient"
    assert all(re.fullmatch(CODE, o["text"]) for o in over), [o["text"] for o in over]
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in plain]
