"""update_weights_from_distributed over gloo: a trainer process broadcasts, the CPU engine loads.

The trainer is a real second process (rank 0, it hosts the rendezvous store), as in RL: it joins
the group, broadcasts the other checkpoint's tensors, then an extra tensor under an unknown name.
Oracle: an engine started on that checkpoint.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.engine.conftest import random_prompts

REPO = Path(__file__).resolve().parents[2]  # the repo root: the trainer imports engine, weight_sync
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
TRAINER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    from engine.models.loader import safetensors_files
    from weight_sync.nccl import WeightGroup
    port, model_dir = int(sys.argv[1]), sys.argv[2]
    group = WeightGroup("127.0.0.1", port, 0, 2, "wg", backend="gloo", timeout_s=60)
    named = [kv for path in safetensors_files(model_dir) for kv in load_file(path).items()]
    for _, tensor in named:
        group.broadcast(tensor.contiguous(), src=0)
    group.broadcast(torch.ones(3), src=0)  # the second update: one tensor, an unknown name
    print("trainer done", flush=True)
    import os
    os._exit(0)  # skip the gloo group's teardown at exit: the test is over, its peer may be gone
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_update_equals_an_engine_on_the_new_weights(engine_factory, other_model_dir, other_engine):
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=7)
    before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
    named = [kv for path in safetensors_files(other_model_dir) for kv in load_file(path).items()]
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), other_model_dir], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ok, message = eng.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", backend="gloo")
        assert ok, message
        assert eng.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", backend="gloo")[0] is False
        ok, message = eng.update_weights_from_distributed(
            [n for n, _ in named], [str(t.dtype) for _, t in named], [list(t.shape) for _, t in named],
            "wg", weight_version="dist-1")
        assert ok, message
        after = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after == [o["output_ids"] for o in other_engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after != before and eng.get_weight_version() == "dist-1"
        ok, message = eng.update_weights_from_distributed(  # the bad dtype is second: still nothing received
            ["model.norm.weight", "model.norm.weight"], ["float32", "float23"], [[64], [64]], "wg")
        assert not ok and "unknown dtype 'float23'" in message and "nothing was received" in message
        ok, message = eng.update_weights_from_distributed(["model.nope.weight"], ["float32"], [[3]], "wg")
        assert not ok and "unknown weight 'model.nope.weight'" in message, message
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)] == after
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "trainer done" in out, (trainer.returncode, out)
    finally:
        trainer.kill()
    ok, message = eng.update_weights_from_distributed(["x"], ["float32"], [[1]], "other")
    assert not ok and "init_weights_update_group first" in message
    assert eng.destroy_weights_update_group("wg")[0] and not eng.destroy_weights_update_group("wg")[0]
    with pytest.raises(ValueError, match="load_format"):
        eng.update_weights_from_distributed([], [], [], "wg", load_format="flattened_bucket")
    eng.check_integrity()


def test_bad_group_arguments_are_named(engine_factory):
    eng = engine_factory()
    ok, message = eng.init_weights_update_group("127.0.0.1", _free_port(), 1, 2, "g", backend="mpi")
    assert not ok and "backend must be one of nccl, gloo" in message
    ok, message = eng.init_weights_update_group("127.0.0.1", _free_port(), 2, 2, "g", backend="gloo")
    assert not ok and "rank 2 is outside a group of world_size 2" in message
