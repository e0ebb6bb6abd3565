"""The engine core in its own process on the GPU (core_process=True): greedy outputs equal the
thread core's under CUDA graphs; weight updates whose tensors are CUDA tensors reach the core by
IPC handle (allocated here, or opened here from a trainer process's handle and passed on); a
killed core fails requests at once. Float32 tiny model: same kernels, same batch, same tokens.
Written without a GPU: not yet run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 90))]
TRAINER = """
import sys, torch
from safetensors.torch import load_file
from engine.models.loader import safetensors_files
from weight_sync.bucket import FlattenedBucket
from weight_sync.cuda_ipc import serialize
named = [(n, t.cuda()) for p in safetensors_files(sys.argv[1]) for n, t in load_file(p).items()]
bucket = FlattenedBucket.pack(named)
print(serialize(bucket.to_payload(), as_text=True), flush=True)
sys.stdin.readline()  # keep the tensors alive until the engine has loaded them
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from engine.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("coreproc")
    return (str(build_tiny_model(root / "a", preset="tiny", seed=0)),
            str(build_tiny_model(root / "b", preset="tiny", seed=1)))


def _engine(path: str, core_process: bool):
    from engine import Engine

    return Engine(model_path=path, device="cuda", dtype="float32", cuda_graph_max_bs=8, max_total_tokens=8192,
                  core_process=core_process)


def _ids(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    out = {}
    for name, path in zip(("a", "b"), checkpoints):
        eng = _engine(path, core_process=False)
        try:
            out[name] = _ids(eng)
        finally:
            eng.shutdown()
    return out


@pytest.fixture(scope="module")
def proc_engine(checkpoints):
    eng = _engine(checkpoints[0], core_process=True)
    yield eng
    eng.shutdown()


def test_outputs_equal_the_thread_core(proc_engine, expected):
    assert proc_engine.info.device.startswith("cuda") and proc_engine.local_core is None
    assert _ids(proc_engine) == expected["a"]


def test_cuda_tensors_of_this_process_reach_the_core(proc_engine, checkpoints, expected):
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    try:
        named = [(n, t.cuda()) for p in safetensors_files(checkpoints[1]) for n, t in load_file(p).items()]
        torch.cuda.synchronize()
        start = time.perf_counter()
        ok, message = proc_engine.update_weights_from_tensor(named, weight_version="gpu-1")
        print(f"  cross-process CUDA tensor update: {(time.perf_counter() - start) * 1e3:.1f} ms")
        assert ok, message
        assert _ids(proc_engine) == expected["b"]
    finally:
        assert proc_engine.update_weights_from_disk(checkpoints[0], weight_version="default")[0]
    assert _ids(proc_engine) == expected["a"]


def test_cuda_ipc_bucket_from_a_trainer_process_is_passed_on(proc_engine, checkpoints, expected):
    """The HTTP route's path: the payload stays serialized until the core process opens the
    trainer's handle; a handle the front end already opened cannot be shared on, and says so."""
    from weight_sync.cuda_ipc import deserialize

    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, checkpoints[1]],
                               env=dict(os.environ, PYTHONPATH=str(REPO)),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        serialized = trainer.stdout.readline().strip()
        opened = deserialize(serialized)
        with pytest.raises(ValueError, match="update_weights_from_serialized"):
            proc_engine.update_weights_from_tensor(opened, load_format="flattened_bucket")
        del opened
        ok, message = proc_engine.update_weights_from_serialized(serialized, load_format="flattened_bucket",
                                                                 weight_version="ipc-1")
        assert ok, message
        torch.cuda.ipc_collect()
        assert _ids(proc_engine) == expected["b"]
    finally:
        trainer.communicate("done\n", timeout=60)
        assert proc_engine.update_weights_from_disk(checkpoints[0], weight_version="default")[0]


def test_a_killed_core_fails_requests_at_once(checkpoints):
    eng = _engine(checkpoints[0], core_process=True)
    result: dict = {}
    long = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
    worker = threading.Thread(target=lambda: result.update(out=eng.generate(input_ids=[5, 6], sampling_params=long)))
    worker.start()
    time.sleep(1.0)
    os.kill(eng.client.process.pid, signal.SIGKILL)
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert "core process exited" in result["out"]["meta_info"]["finish_reason"]["message"]
    assert not eng.is_alive()
    eng.shutdown()
