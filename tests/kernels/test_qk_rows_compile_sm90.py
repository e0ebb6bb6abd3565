"""qk_norm_rope's heads a program (TANDEM_QK_ROWS) compiled for the H200 (sm_90) on a machine
without a GPU: at 2, 4 and 8 heads a program each head's sum of squares is the same instruction
sequence as at one (the in-thread adds, then five butterfly shuffles: triton_norm's tree, which
tests/gpu checks bit for bit at one head a program), and every head's loads are issued before
the barrier that precedes the in-place stores, so a program has all its rows in flight at once."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.kernels.sm90_subprocess import STAND_IN_DRIVER, run_for_sm90  # noqa: E402

SCRIPT = STAND_IN_DRIVER + r"""
import json, re, sys
import torch
from engine.kernels import qk_norm_rope as mod
from engine.kernels.compile_ahead import CompileAhead

rows = int(sys.argv[1])
mod.ROWS = rows
bf = torch.bfloat16

def launch():
    q, k = torch.zeros(256, 16, 128, dtype=bf), torch.zeros(256, 8, 128, dtype=bf)
    cos = torch.zeros(256, 128)
    mod.qk_norm_rope(q, k, cos, cos, torch.zeros(128, dtype=bf), torch.zeros(128, dtype=bf), 1e-6)

ahead = CompileAhead(workers=1)
with ahead.dry_pass():
    assert ahead.run(launch)
assert not ahead.wait().failed
(ptx,) = [future.result().asm["ptx"] for _, future in ahead._futures.values()]

def reductions(ptx):
    # each rsqrt's sum of squares: the float ops and shuffles since the previous rsqrt, registers elided
    ops, seqs = [], []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if re.match(r"(shfl|add\.rn\.f32|mul\.rn\.f32|fma|div)", line):
            ops.append(re.sub(r"%[a-z]+\d+", "R", line))
        elif line.startswith("rsqrt"):
            seqs.append(ops[-19:])  # 4 squares, 3 in-thread adds, 5 x (shuffle, add), the mean's div + eps add
            ops = []
    return seqs

halves = ptx.split("bar.sync")
print(json.dumps({"reductions": reductions(ptx), "loads_before_barrier": len(re.findall(r"ld\.global", halves[0])),
                  "stores_before_barrier": len(re.findall(r"st\.global", halves[0]))}))
"""


def _compiled(rows: int, cache) -> dict:
    import json

    done = run_for_sm90(SCRIPT, str(rows), cache_dir=cache)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_head_reduces_as_at_one_head_a_program(tmp_path):
    one = _compiled(1, tmp_path / "cache")
    (tree,) = set(map(tuple, one["reductions"]))  # the q branch's and the k branch's: one sequence
    assert sum("shfl.sync.bfly" in op for op in tree) == 5 and tree[-1].startswith("add.rn.f32")
    for rows in (2, 4, 8):
        got = _compiled(rows, tmp_path / "cache")
        assert len(got["reductions"]) == 2 * rows  # a q branch and a k branch, `rows` heads each
        assert set(map(tuple, got["reductions"])) == {tree}, rows
        # the q branch comes first: cos, sin, the two weight loads, then x and its partner per head
        assert got["loads_before_barrier"] == 4 + 2 * rows and got["stores_before_barrier"] == 0, (rows, got)
