"""The decode path's start-up and launch switches against the engine without them, each engine in a
fresh process (its own Triton cache, empty at first: a fresh machine's start-up):
- TANDEM_COMPILE_AHEAD (engine/kernels/compile_ahead.py; auto, the default): the graphs' Triton
  kernels compiled on a thread pool before capture on an empty cache, the log naming how many; a
  second start on that cache finds the marker and skips the pass;
- TANDEM_PDL=1 (engine/kernels/pdl.py): small batches' kernels launched with programmatic
  dependent launch; only scheduling changes, so tokens and logprobs are bitwise the same. (The
  default, wide, also moves qkv and gate_up to another kernel: tests/gpu/test_decode_kernels_gpu.py
  and test_hf_greedy_gpu.py hold it to cuBLAS and HF.)
Greedy decoding at batch 19 (the graph of 24, padded) and batch 1. Run with -s for the start-up times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from engine import Engine
start = time.perf_counter()
eng = Engine(model_path=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy", cuda_graph_max_bs=64,
             max_total_tokens=16384)
ready = time.perf_counter() - start
params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
prompts = [[5 + i, 6, 7, 8 + i] for i in range(19)]
outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
single = eng.generate(input_ids=prompts[0], sampling_params=params, return_logprob=True)
eng.shutdown()
logprobs = lambda o: [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
print(json.dumps({"ready_s": ready, "tokens": [o["output_ids"] for o in outs], "single": single["output_ids"],
                  "logprobs": [logprobs(o) for o in outs], "single_logprobs": logprobs(single)}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("opt-in") / "q06", preset="qwen3-0.6b"))


def _start(model: str, cache: Path, **env: str) -> tuple[dict, str]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), **env,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory) -> dict:
    return _start(model, tmp_path_factory.mktemp("cache-plain"), TANDEM_COMPILE_AHEAD="0", TANDEM_PDL="0")[0]


def test_compiled_ahead_engine_decodes_as_the_one_compiling_in_capture(model, plain, tmp_path):
    ahead, log = _start(model, tmp_path / "cache", TANDEM_PDL="0")  # auto, on an empty cache
    line = next((x for x in log.splitlines() if "ahead of capture" in x), "")
    print(f"\n  fresh Triton cache, ready: kernel by kernel {plain['ready_s']:.1f} s, "
          f"compiled ahead {ahead['ready_s']:.1f} s | {line.split('] ')[-1]}")
    assert "compiled" in line and "failed" not in line, log[-3000:]
    assert int(line.split("compiled ")[1].split()[0]) > 0
    assert ahead["tokens"] == plain["tokens"] and ahead["single"] == plain["single"]
    again, log = _start(model, tmp_path / "cache", TANDEM_PDL="0")  # the marker: no dry pass
    assert "ahead of capture" not in log and again["tokens"] == plain["tokens"]
    print(f"  the same cache again: ready {again['ready_s']:.1f} s")


def test_pdl_engine_decodes_bitwise_as_the_plain_one(model, plain, tmp_path):
    pdl, _ = _start(model, tmp_path / "cache", TANDEM_COMPILE_AHEAD="0", TANDEM_PDL="1")
    for key in ("tokens", "single", "logprobs", "single_logprobs"):
        assert pdl[key] == plain[key], key
