"""TANDEM_COMPILE_AHEAD=1 (engine/kernels/compile_ahead.py): the decode graphs' Triton kernels
compiled on a thread pool before capture. Each engine starts in a fresh process with an empty
Triton cache (a fresh machine's start-up); the greedy tokens must equal those of the engine that
compiled kernel by kernel inside its captures. Run with -s for both start-up times."""

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
eng = Engine(model_path=sys.argv[1], device="cuda", dtype="bfloat16", cuda_graph_max_bs=64, max_total_tokens=16384)
ready = time.perf_counter() - start
params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
prompts = [[5 + i, 6, 7, 8 + i] for i in range(19)]  # 19 rows: the graph of 24, padded
outs = eng.generate(input_ids=prompts, sampling_params=params)
single = eng.generate(input_ids=prompts[0], sampling_params=params)
eng.shutdown()
print(json.dumps({"ready_s": ready, "tokens": [o["output_ids"] for o in outs], "single": single["output_ids"]}))
"""


def _start(model: str, cache: Path, ahead: str) -> tuple[dict, str]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TANDEM_COMPILE_AHEAD": ahead,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_compiled_ahead_engine_decodes_as_the_one_compiling_in_capture(tmp_path):
    from engine.testing.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model", preset="qwen3-0.6b"))
    plain, _ = _start(model, tmp_path / "cache-plain", "0")
    ahead, log = _start(model, tmp_path / "cache-ahead", "1")
    line = next((x for x in log.splitlines() if "ahead of capture" in x), "")
    print(f"\n  fresh Triton cache, ready: kernel by kernel {plain['ready_s']:.1f} s, "
          f"compiled ahead {ahead['ready_s']:.1f} s | {line.split('] ')[-1]}")
    assert "compiled" in line and "failed" not in line, log[-3000:]
    assert int(line.split("compiled ")[1].split()[0]) > 0
    assert ahead["tokens"] == plain["tokens"] and ahead["single"] == plain["single"]
