"""Running a script that compiles Triton kernels for the H200 (sm_90) on a machine without a GPU.

In a subprocess: the interpreter tests set TRITON_INTERPRET=1 in the pytest process, and Triton
reads it once. STAND_IN_DRIVER, prepended to a script, makes Triton's JIT path run for the sm_90
target: it answers the current device, stream and target, loads no binary, and its launcher calls
the launch-enter hook (as Triton's C launcher does) and then fails: nothing launches on a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]

STAND_IN_DRIVER = r"""
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class StandInLauncher:
    def __init__(self, src, metadata): pass
    def __call__(self, *args):
        enter_hook, launch_metadata = args[7], args[6]
        if enter_hook is not None:
            enter_hook(launch_metadata)
        raise AssertionError("a kernel launched on the stand-in driver")

class StandInUtils:
    def load_binary(self, name, kernel, shared, device): return None, None, 0, 0, 1024
    def get_device_properties(self, device): return {"max_shared_mem": 227 * 1024}

class StandInDriver:
    launcher_cls = StandInLauncher
    utils = StandInUtils()
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

driver.set_active(StandInDriver())
"""


def run_for_sm90(script: str, *args: str, cache_dir: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Runs `script` (python -c, from the repo root) without TRITON_INTERPRET, in a Triton cache of
    its own when given; skips where this Triton has no ptxas; fails on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("this Triton build has no ptxas to compile with")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done
