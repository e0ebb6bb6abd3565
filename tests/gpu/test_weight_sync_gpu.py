"""Weight updates on the GPU: in-process CUDA tensors under CUDA graphs, and CUDA IPC handles from
a trainer process on the same GPU (weight_sync.cuda_ipc), each against an engine started on the
new checkpoint (float32 tiny model: same kernels, same batch, so the same tokens). Run with -s for
timings. The SGLang test's trainer builds its payload the way SGLang does: its patched CUDA
reduction (`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`, the device as a GPU UUID)
and its bucket metadata class, reproduced under SGLang's module names (sglang is not installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
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
bucket = FlattenedBucket.pack(named)  # one CUDA buffer, one IPC handle
print(serialize(bucket.to_payload(), as_text=True), flush=True)
sys.stdin.readline()  # keep the tensors alive until the engine has loaded them
"""


SGLANG_TRAINER = """
import base64, dataclasses, sys, types, torch
import torch.multiprocessing.reductions as R
from multiprocessing.reduction import ForkingPickler
from safetensors.torch import load_file
from engine.models.loader import safetensors_files
from weight_sync.bucket import FlattenedBucket
for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.weight_sync"):
    sys.modules[name] = types.ModuleType(name)
patch_torch = sys.modules["sglang.srt.utils.patch_torch"] = types.ModuleType("sglang.srt.utils.patch_torch")
tensor_bucket = sys.modules["sglang.srt.weight_sync.tensor_bucket"] = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
def _rebuild_cuda_tensor_modified(*args):
    raise AssertionError("the engine side rebuilds this")
_rebuild_cuda_tensor_modified.__module__ = patch_torch.__name__
patch_torch._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int
FlattenedTensorMetadata.__module__ = tensor_bucket.__name__
tensor_bucket.FlattenedTensorMetadata = FlattenedTensorMetadata
original = R.reduce_tensor
def reduce_tensor(tensor):  # SGLang's monkey_patch_torch_reductions: device index -> GPU UUID
    fn, args = original(tensor)
    if fn is R.rebuild_cuda_tensor:
        fn, args = _rebuild_cuda_tensor_modified, (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args
R.reduce_tensor = reduce_tensor
R.init_reductions()
named = [(n, t.cuda()) for p in safetensors_files(sys.argv[1]) for n, t in load_file(p).items()]
bucket = FlattenedBucket.pack(named)
payload = {"flattened_tensor": bucket.flattened_tensor,
           "metadata": [FlattenedTensorMetadata(**dataclasses.asdict(m)) for m in bucket.metadata]}
data = bytes(ForkingPickler.dumps(payload))
assert b"sglang.srt.utils.patch_torch" in data and b"sglang.srt.weight_sync.tensor_bucket" in data
print(base64.b64encode(data).decode("utf-8"), flush=True)  # MultiprocessingSerializer(output_str=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from engine.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("wsync")
    return (str(build_tiny_model(root / "a", preset="tiny", seed=0)),
            str(build_tiny_model(root / "b", preset="tiny", seed=1)))


def _engine(path: str):
    from engine import Engine

    return Engine(model_path=path, device="cuda", dtype="float32", cuda_graph_max_bs=8, max_total_tokens=8192)


def _ids(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def expected(checkpoints) -> list[list[int]]:
    eng = _engine(checkpoints[1])
    try:
        return _ids(eng)
    finally:
        eng.shutdown()


def test_in_process_cuda_tensors_under_graphs(checkpoints, expected):
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    eng = _engine(checkpoints[0])
    try:
        before = _ids(eng)
        named = [(n, t.cuda()) for p in safetensors_files(checkpoints[1]) for n, t in load_file(p).items()]
        torch.cuda.synchronize()
        start = time.perf_counter()
        ok, message = eng.update_weights_from_tensor(named, weight_version="gpu-1")
        print(f"  in-process update: {(time.perf_counter() - start) * 1e3:.1f} ms")
        assert ok, message
        assert _ids(eng) == expected != before
        assert eng.local_core.parts.runner.cuda_graph.num_replays > 0  # the graphs read the new weights
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("script", [TRAINER, SGLANG_TRAINER], ids=["tandem", "sglang"])
def test_cuda_ipc_bucket_from_a_trainer_process(checkpoints, expected, script):
    from weight_sync.cuda_ipc import deserialize

    eng = _engine(checkpoints[0])
    trainer = subprocess.Popen([sys.executable, "-c", script, checkpoints[1]], env=dict(os.environ, PYTHONPATH=str(REPO)),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        payload = deserialize(trainer.stdout.readline().strip())
        assert payload["flattened_tensor"].is_cuda
        start = time.perf_counter()
        ok, message = eng.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="ipc-1")
        print(f"  IPC bucket update: {(time.perf_counter() - start) * 1e3:.1f} ms")
        assert ok, message
        del payload
        torch.cuda.ipc_collect()
        assert _ids(eng) == expected
        eng.check_integrity()
    finally:
        trainer.communicate("done\n", timeout=60)
        eng.shutdown()
    assert trainer.returncode == 0


def test_bench_sync_ipc_from_a_spawned_trainer_keeps_memory_flat(tmp_path):
    """50 updates from a trainer process that reuses its bucket buffers: the engine holds the
    trainer's weights and device memory does not grow (each update re-sends the same handles)."""
    import json

    from tandem.main import main

    out = tmp_path / "sync.json"
    assert main(["bench-sync", "--preset", "tiny", "--transport", "cuda-ipc", "--trainer", "process",
                 "--num-updates", "50", "--bucket-mb", "0.25", "--max-total-tokens", "8192", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    print(f"  bench-sync tiny cuda-ipc: median total {report['median_s']['total'] * 1e3:.1f} ms")
    assert report["weights_match_trainer"] and report["num_buckets"] >= 2
    mem = report["memory"]
    assert mem["after"]["device_used_gb"] - mem["after_first"]["device_used_gb"] < 1 / 16  # < 64 MB
