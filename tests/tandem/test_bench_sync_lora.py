"""`tandem bench-sync --lora-rank R` on the CPU with the tiny model: an adapter pushed from a spawned
trainer by reference (shared memory here, CUDA IPC on a GPU) through the allowlist unpickler,
replacing the served one each time; the phases add up and the engine serves the trainer's adapter."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.bench_sync import LocalTrainer
from tandem.bench_sync_lora import PHASES, measure_pushes
from tandem.lora_sync_trainer import LoRATrainer
from tandem.main import main

TINY = ["bench-sync", "--preset", "tiny", "--device", "cpu", "--dtype", "float32"]


def _check(report: dict, num_pushes: int) -> None:
    medians = report["median_s"]
    assert set(medians) == set(PHASES) and all(v >= 0 for v in medians.values())
    assert medians["load"] > 0 and medians["push"] >= medians["load"]
    assert len(report["pushes_s"]) == num_pushes
    assert report["adapter_changes_output"] is True
    assert report["later_push_changes_output"] is True  # each push is a new adapter
    assert report["engine_adapter_matches_trainer"] is True


def test_cli_pushes_from_a_spawned_trainer(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert main([*TINY, "--transport", "cuda-ipc", "--trainer", "process", "--lora-rank", "8", "--num-updates", "3",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check(report, 3)
    assert report["trainer"] == "process" and report["load_format"] == "flattened_bucket"
    assert report["lora_rank"] == 8 and len(report["lora_target_modules"]) == 7
    assert report["num_tensors"] == 2 * 7 * 2  # lora_A + lora_B, 7 linears, 2 layers
    assert report["total_bytes"] == 4 * 8 * 2 * sum(i + o for i, o in [(64, 64), (64, 32), (64, 32), (64, 64),
                                                                          (64, 128), (64, 128), (128, 64)])
    assert report["memory"] is None  # no GPU here
    assert "LoRA push" in capsys.readouterr().out


def test_inprocess_push_and_target_modules(engine_factory):
    eng = engine_factory(enable_lora=True, max_lora_rank=4)
    trainer = LocalTrainer(LoRATrainer, model_path=eng.info.model_path, dtype="float32", device="cpu", rank=4,
                           target_modules=("q_proj", "o_proj"))
    report = measure_pushes(eng, trainer, "inprocess", 2, "direct")
    _check(report, 2)
    assert trainer.layout["lora_target_modules"] == ["q_proj", "o_proj"] and trainer.layout["num_tensors"] == 8
    # each push replaced the one adapter; the disk copy of the check is gone
    assert eng.unload_lora_adapter("bench-lora")["loaded_adapters"] == {}
    eng.check_integrity()


@pytest.mark.parametrize("load_format", ["flattened_bucket", "direct"])
def test_payload_opens_through_the_allowlist_to_the_trainers_tensors(tiny_model_dir, load_format):
    """What the engine's core does with serialized_tensors: the trainer's tensors, by name."""
    from engine.lora.tensor_payload import lora_tensors

    trainer = LoRATrainer(tiny_model_dir, "float32", "cpu", rank=2)
    source = lora_tensors(trainer.payload(load_format), load_format)
    opened = dict(source.open().pairs())
    sent = dict(trainer.bucket.unpack())
    assert opened.keys() == sent.keys() and len(sent) == 28
    assert all(torch.equal(opened[name], sent[name]) for name in sent)
    trainer.step(7)  # shared by reference: the opened tensors see the trainer's new adapter
    assert all(torch.equal(opened[name], sent[name]) for name in sent)


def test_lora_push_refuses_other_transports(capsys):
    with pytest.raises(SystemExit, match="pushed by reference"):
        main([*TINY, "--transport", "disk", "--lora-rank", "4"])
    with pytest.raises(SystemExit, match="--lora-rank >= 0"):
        main([*TINY, "--lora-rank", "-1"])
