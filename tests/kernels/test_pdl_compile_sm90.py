"""TANDEM_PDL's kernels (engine/kernels/pdl.py) compile for the H200 (sm_90) on a machine without a
GPU, each with `griddepcontrol.wait` before its first global store and before every load but the
small-M gemv's first weight tile (weights are not written during a step) and its L2 prefetch of the
rest of its slice, and the launch flag set.
Deterministic mode's batch-invariant matmul takes it too (its arithmetic is the same either way).
The decode wrappers run under CompileAhead's dry pass (engine/kernels/compile_ahead.py) with a
stand-in driver and PDL forced on: what they would launch at batch 1 is compiled, not launched
(tests/kernels/sm90_subprocess.py).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.kernels.sm90_subprocess import STAND_IN_DRIVER, run_for_sm90  # noqa: E402

SCRIPT = STAND_IN_DRIVER + r"""
import re
import torch
from engine.kernels import pdl
for module in ("small_m_linear", "qk_norm_rope", "silu_and_mul", "split_kv_attention", "batch_invariant.triton_norm",
               "batch_invariant.triton_matmul"):
    __import__(f"engine.kernels.{module}")
    setattr(__import__(f"engine.kernels.{module}", fromlist=["use_pdl"]), "use_pdl", lambda rows, device: True)
from engine.kernels.compile_ahead import CompileAhead
from engine.kernels.small_m_linear import small_m_linear, small_m_linear_add_norm, GemvConfig
from engine.kernels.qk_norm_rope import qk_norm_rope
from engine.kernels.silu_and_mul import silu_and_mul
from engine.kernels.batch_invariant.triton_norm import rms_norm
from engine.kernels.batch_invariant.triton_matmul import MatmulConfig, matmul
from engine.kernels.split_kv_attention import split_kv_attention
from engine.kernels.split_kv_tile import Tile
from engine.attention.split_kv_plan import DEFAULT_CONFIGS as DECODE_CONFIGS

bf = torch.bfloat16
def decode_layer_kernels():
    x, w = torch.zeros(1, 2048, dtype=bf), torch.zeros(1024, 2048, dtype=bf)
    small_m_linear(x, w, config=GemvConfig(64, 128, 4))
    small_m_linear_add_norm(x, w, None, torch.zeros(1, 1024, dtype=bf), torch.zeros(1024, dtype=bf), 1e-6,
                            config=GemvConfig(64, 128, 4))
    q, k = torch.zeros(1, 16, 128, dtype=bf), torch.zeros(1, 8, 128, dtype=bf)
    cos = torch.zeros(1, 128)
    qk_norm_rope(q, k, cos, cos, torch.zeros(128, dtype=bf), torch.zeros(128, dtype=bf), 1e-6)
    silu_and_mul(torch.zeros(1, 6144, dtype=bf))
    rms_norm(torch.zeros(1, 1024, dtype=bf), torch.zeros(1024, dtype=bf), 1e-6, torch.zeros(1, 1024, dtype=bf))
    # deterministic mode's linears: split K, one program per (tile, split) summed by the last, or a tile's splits in turn
    for schedule in ("par", "seq"):
        matmul(x, w, None, MatmulConfig(block_m=16, block_n=64, split_k=1024), schedule)
    # decode attention at batch 1, split over 4 lanes: stage 1's partials, stage 2's merge
    tile = Tile.build(DECODE_CONFIGS["decode"], group=2, split=1 << 30)
    kv = torch.zeros(64, 8, 128, dtype=bf)
    split_kv_attention(q, kv, kv.clone(), torch.zeros_like(q), torch.zeros(1, 64, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int64), torch.zeros(5, 1, dtype=torch.int32), 1, 0.1, tile, 4,
                       torch.zeros(1, 16, 4, 128), torch.zeros(1, 16, 4, 2))

ahead = CompileAhead(workers=2)
with ahead.dry_pass():
    assert ahead.run(decode_layer_kernels)
report = ahead.wait()
assert not report.failed, report.failed
kernels = [(name, future.result()) for name, future in ahead._futures.values()]  # each variant
W_TILE_LOADS = 64 * 128 * 2 // (16 * 32 * 4)  # the gemv's first [64, 128] bf16 weight tile, 16 B a load, 4 warps
for name, kernel in kernels:
    ptx = kernel.asm["ptx"]
    before, wait, after = ptx.partition("griddepcontrol.wait")
    assert wait, f"{name}: no griddepcontrol.wait"
    loads = len(re.findall(r"ld\.global", before))
    assert not re.search(r"st\.global|cp\.async|atom\.", before), f"{name}: a store before the wait"
    # only the gemv reads before its wait: its first weight tile, which no kernel writes in a step,
    # and it asks L2 for the rest of its slice (6 lines of each of 64 rows, rounded up to 8: 4 a thread)
    assert loads == (W_TILE_LOADS if name == "_gemv_kernel" else 0), f"{name}: {loads} loads before the wait"
    assert before.count("prefetch.global.L2") == (4 if name == "_gemv_kernel" else 0), name
    assert "prefetch" not in after, name
    assert re.search(r"ld\.global|cp\.async", after), name  # x, after the wait
    assert "griddepcontrol.launch_dependents" in after, name
    assert kernel.metadata.launch_pdl, name
    print("pdl", name)
"""


def test_pdl_kernels_wait_before_reading_what_kernels_write(tmp_path):
    done = run_for_sm90(SCRIPT, cache_dir=tmp_path / "triton-cache")
    names = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("pdl ")}
    assert {"_gemv_kernel", "_split_sum_kernel", "_split_sum_add_norm_kernel", "_qk_norm_rope_kernel",
            "_silu_and_mul_kernel", "_rms_norm_kernel", "split_kv_stage1", "split_kv_stage2", "_bi_mm_kernel"} <= names, names
