"""tandem/group_trainer.py's trainer process (bench-sync --transport nccl's rank 0) on the
CPU: a call that fails there is raised here with the trainer's error, and the trainer keeps
serving; a trainer that is gone is named with its exit code (was: a bare EOFError)."""

from __future__ import annotations

import pytest

from tandem.group_trainer import GroupTrainerProcess
from engine.models.parallel_state import free_port
from engine.testing.tiny_model import build_tiny_model
from weight_sync.weight_group import WeightGroup


def test_a_failed_call_raises_the_trainers_error_and_a_gone_trainer_is_named(tmp_path):
    model = build_tiny_model(tmp_path, preset="tiny", seed=0)
    port = free_port()
    group_args = dict(master_address="127.0.0.1", master_port=port, world_size=2, group_name="bench",
                      backend="gloo", timeout_s=30.0)
    trainer = GroupTrainerProcess(group_args, model_path=str(model), dtype="float32", device="cpu",
                                  bucket_bytes=1 << 16)
    group = None
    try:
        group = WeightGroup("127.0.0.1", port, 1, 2, "bench", backend="gloo", timeout_s=30.0)
        trainer.joined(30.0)
        with pytest.raises(RuntimeError, match=r"the trainer's call first_rows failed: KeyError: 'no\.such\.weight'"):
            trainer.call("first_rows", "no.such.weight", 2)
        assert trainer.call("tensor_names")  # still serving
        trainer._process.kill()
        trainer._process.join(10)
        with pytest.raises(RuntimeError, match=r"the trainer process exited \(code -9\)"):
            trainer.call("tensor_names")
    finally:
        trainer.stop()
        if group is not None:
            group.destroy()
