"""Tensor parallelism when something goes wrong (issue 15): a dead rank, a rank that dies at
start, shutdown with a rank gone, a pass that fails on rank 0, a trainer's group too small for
every rank. Each must fail at once with a message naming it, never hang or let the ranks diverge.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.models.parallel_state import free_port
from tests.engine.test_tensor_parallel import _greedy, _prompts

ROOT = Path(__file__).resolve().parents[2]


def test_engine_tp2_a_dead_rank_fails_requests_at_once(tiny_model_dir):
    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    try:
        worker = eng.client.core.runner.tp.processes[0]
        worker.kill()
        worker.join()
        out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})[0]
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "tensor-parallel rank 1 (exit code -9) exited" in reason["message"]
        ok, message, _ = eng.update_weights_from_disk(tiny_model_dir)
        assert not ok and message.startswith("Weights not updated: tensor-parallel rank 1")
        with pytest.raises(ValueError, match="tp_size > 1"):
            eng.get_weights_by_name("model.norm.weight")
    finally:
        eng.shutdown()


def test_engine_tp4_shutdown_with_a_dead_rank_is_prompt_and_frees_the_group(tiny_model_dir):
    """A dead rank cannot pass rank 0's Stop on: the living ranks are killed at once (not each
    waited for), and rank 0's TCPStore and process groups are closed (its port refuses)."""
    import socket
    import time

    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, tp_size=4, dtype="float32", device="cpu")
    driver = eng.client.core.runner.tp
    port = driver.group._store.port
    driver.processes[0].kill()
    driver.processes[0].join()
    start = time.monotonic()
    eng.shutdown()
    assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in driver.processes)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_a_rank_that_dies_before_the_rendezvous_fails_the_start_at_once(tiny_model_dir, monkeypatch):
    """A worker that exits at start (no GPU of its own, a broken install) is named at once, not
    after the rendezvous timeout; with NCCL, too few GPUs are refused before any process starts."""
    import datetime
    import time

    from engine.config import ServerArgs
    from engine.models import parallel_state
    from engine.runner import tp_worker
    from engine.runner.tp_driver import TPDriver

    monkeypatch.setattr(parallel_state, "RENDEZVOUS_TIMEOUT", datetime.timedelta(seconds=20))
    monkeypatch.setattr(tp_worker, "run_tp_worker", os._exit)  # the child raises a TypeError and exits 1
    args = ServerArgs(model_path=tiny_model_dir, tp_size=2, device="cpu")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(exit code 1\) exited before joining"):
        TPDriver(args, torch.device("cpu"))
    assert time.monotonic() - start < 15
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tp_size 2 needs 2 GPUs; 1 is visible"):
        TPDriver(args, torch.device("cuda"))


SMALL_GROUP_TRAINER = textwrap.dedent("""
    import os, sys, torch
    from safetensors.torch import load_file
    from weight_sync.weight_group import WeightGroup
    port, path = int(sys.argv[1]), sys.argv[2]
    group = WeightGroup("127.0.0.1", port, 0, 2, "small", backend="gloo", timeout_s=30)  # no room for rank 2
    for _, tensor in load_file(path).items():
        group.broadcast(tensor.contiguous(), src=0)
    print("trainer done", flush=True)
    os._exit(0)
""")


def test_engine_tp2_a_group_too_small_for_every_rank_is_refused_and_no_rank_changes(engine, tiny_model_dir,
                                                                                   other_model_dir):
    """world_size counts the trainer and every tensor-parallel rank (rank_offset + t): a group of 2
    for a TP=2 engine at rank_offset 1 forms with rank 0 alone, so rank 1 can never receive. The
    update is refused naming the world size (rank 0 still receives and drops the broadcast, so the
    trainer is not left waiting), and no rank's weights change (rank 0 loading alone would leave
    the ranks on different weights)."""
    from safetensors.torch import load_file

    from engine import Engine

    prompts = _prompts()
    expected = _greedy(engine, prompts)[0]
    named = list(load_file(os.path.join(other_model_dir, "model.safetensors")).items())
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    trainer = subprocess.Popen([sys.executable, "-c", SMALL_GROUP_TRAINER, str(port),
                                os.path.join(other_model_dir, "model.safetensors")], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "small", backend="gloo", timeout_s=30)
        assert ok, message
        specs = ([n for n, _ in named], [str(t.dtype) for _, t in named], [list(t.shape) for _, t in named], "small")
        ok, message = eng.update_weights_from_distributed(*specs, weight_version="v1")
        assert not ok and message.startswith("Weights not updated") and "world_size >= 3" in message, message
        assert trainer.wait(timeout=30) == 0, trainer.stdout.read()
        assert _greedy(eng, prompts)[0] == expected and eng.get_weight_version() == "default"
    finally:
        trainer.kill()
        eng.shutdown()


def test_engine_tp2_a_failed_pass_on_rank_0_stops_the_ranks_instead_of_diverging(tiny_model_dir):
    """Rank 0 raises inside its forward after the workers joined the pass (an OOM, say): they are
    left in its collectives, so the ranks are stopped and every later call fails at once, naming
    why, instead of the next pass pairing with stale collectives."""
    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, tp_size=2, dtype="float32", device="cpu")
    try:
        runner = eng.client.core.runner
        worker = runner.tp.processes[0]
        real_forward = runner.model.forward

        def failing_forward(*args, **kwargs):
            raise RuntimeError("CUDA out of memory (simulated)")

        runner.model.forward = failing_forward
        out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})[0]
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert "CUDA out of memory (simulated)" in out["meta_info"]["finish_reason"]["message"]
        runner.model.forward = real_forward
        worker.join(10)
        assert not worker.is_alive()
        start = time.monotonic()
        out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4})[0]
        message = out["meta_info"]["finish_reason"]["message"]
        assert "stopped after rank 0's forward pass failed" in message and "restarted" in message, message
        ok, message, _ = eng.update_weights_from_disk(tiny_model_dir)
        assert not ok and "stopped after rank 0's forward pass failed" in message
        assert time.monotonic() - start < 10
    finally:
        eng.shutdown()
