"""NCCL weight broadcast between two GPUs (skipped without two): a trainer process on GPU 1, the
engine on GPU 0; a slime-formed group carries flattened buckets and the engine then equals one
started on the new checkpoint; bench-sync --transport nccl reports the phases. Not run on a CPU
machine: written for the lent 2-GPU machine (issue 15)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 90))]
TRAINER = """
import sys, os, torch
torch.cuda.set_device(1)
sys.path.insert(0, sys.argv[1])
from tests.weight_sync.slime_trainer import slime_init_process_group, buckets_of
import torch.distributed as dist
from safetensors.torch import load_file
from engine.models.loader import safetensors_files
from weight_sync.bucket import FlattenedBucket
port, model_dir = int(sys.argv[2]), sys.argv[3]
named = [(k, v.cuda()) for p in safetensors_files(model_dir) for k, v in load_file(p).items()]
pg = slime_init_process_group(f"tcp://127.0.0.1:{port}", 2, 0, "gpu-wg", backend="nccl")
for bucket in buckets_of(named, 1 << 20):
    dist.broadcast(FlattenedBucket.pack(bucket).flattened_tensor, 0, group=pg)
torch.cuda.synchronize()
print("done", flush=True)
os._exit(0)
"""


def test_nccl_broadcast_from_a_trainer_on_another_gpu_equals_an_engine_on_the_new_weights():
    import socket

    from safetensors.torch import load_file

    from engine import Engine
    from engine.models.loader import safetensors_files
    from engine.testing.tiny_model import tiny_model_path
    from tests.weight_sync.slime_trainer import buckets_of

    model_a, model_b = str(tiny_model_path()), str(tiny_model_path(seed=1))
    oracle = Engine(model_path=model_b, dtype="float32", device="cuda:0", mem_fraction_static=0.3)
    expected = [o["output_ids"] for o in oracle.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    oracle.shutdown()
    eng = Engine(model_path=model_a, dtype="float32", device="cuda:0", mem_fraction_static=0.3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(REPO), str(port), model_b], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "gpu-wg", backend="nccl", timeout_s=120)
        assert ok, message
        named = [kv for p in safetensors_files(model_b) for kv in load_file(p).items()]
        buckets = buckets_of(named, 1 << 20)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            ok, message = eng.update_weights_from_distributed(
                [n for n, _ in bucket], [str(t.dtype) for _, t in bucket], [list(t.shape) for _, t in bucket],
                "gpu-wg", flush_cache=last, weight_version="gpu-1" if last else None, load_format="flattened_bucket")
            assert ok, message
        out, _ = trainer.communicate(timeout=120)
        assert "done" in out, out
        assert [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == expected
        assert eng.destroy_weights_update_group("gpu-wg")[0]
    finally:
        trainer.kill()
        eng.shutdown()


def test_bench_sync_nccl_between_two_gpus(tmp_path):
    from tandem.main import main

    out = tmp_path / "nccl.json"
    assert main(["bench-sync", "--preset", "tiny", "--transport", "nccl", "--num-updates", "5",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["weights_match_trainer"] is True and report["transport"] == "nccl"
    print(f"  bench-sync tiny nccl: median total {report['median_s']['total'] * 1e3:.1f} ms")
