"""train_flops counts a train step's matmul FLOPs by hand's rule: 6 per weight per token but the
embedding's, the tied LM head over the response rows, causal attention; 4 per weight when the
weights get no gradient; a MoE block's experts at top_k / num_experts."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from trainer_bridge.train_flops import train_flops


def _model(**config) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(100, 8)
    model.model.proj = nn.Linear(8, 24, bias=False)  # 192 weights
    model.model.mlp = nn.Module()
    model.model.mlp.experts = nn.Module()
    model.model.mlp.experts.w = nn.Parameter(torch.zeros(4, 10, 8))  # 320 expert weights
    model.config = SimpleNamespace(hidden_size=8, num_attention_heads=2, head_dim=4, num_hidden_layers=3,
                                   vocab_size=100, **config)
    return model


def test_a_dense_tied_model_by_hand():
    lens, rows = [5, 3], 4
    attention = 12 * 3 * 2 * 4 * (25 + 9) / 2
    assert train_flops(_model(), lens, rows) == 6 * (192 + 320) * 8 + 6 * 100 * 8 * rows + attention
    assert train_flops(_model(), lens, rows, weight_grads=False) == 4 * (192 + 320) * 8 + 4 * 800 * rows + attention


def test_experts_count_at_top_k_of_num_experts_and_an_untied_head_by_its_weights():
    model = _model(num_experts=4, num_experts_per_tok=1)
    model.lm_head = nn.Linear(8, 50, bias=False)  # untied: its own 400 weights
    assert train_flops(model, [2], 1) == 6 * (192 + 320 / 4) * 2 + 6 * 400 * 1 + 12 * 3 * 2 * 4 * 4 / 2


def test_the_trainer_reports_the_count_of_each_step():
    from engine.testing.tiny_model import tiny_model_path
    from trainer_bridge.losses import LossConfig
    from trainer_bridge.policy import Policy
    from trainer_bridge.rollout_batch import RolloutBatch
    from trainer_bridge.trainer import TorchTrainer

    trainer = TorchTrainer(Policy.from_pretrained(str(tiny_model_path())), LossConfig())
    batch = RolloutBatch([[5, 6], [7]], [[8, 9, 10], [11]], [[1, 1, 1], [1]], [[-1.0] * 3, [-1.0]], [1.0, -1.0])
    metrics = trainer.train_step(batch, 1e-3)
    assert metrics["train_tflop"] == train_flops(trainer.policy.model, [5, 2], 4) / 1e12 > 0


def test_the_run_report_closes_with_each_phases_median_after_step_one():
    from tandem.rl.report import phase_medians_line

    rows = [{"step": s, "rollout_s": r, "train_s": t, "train_tflops": f, "sync_s": 0.04}
            for s, r, t, f in ((1, 9.0, 5.0, 20.0), (2, 1.0, 0.8, 160.0), (3, 1.2, 0.6, 210.0), (4, 1.1, 0.7, 180.0))]
    line = phase_medians_line(rows)
    assert line == ("medians over steps 2-4: rollout 1.100 s, train 0.700 s, train 180 TFLOP/s, push 0.040 s")
    assert phase_medians_line(rows[:1]).startswith("medians over step 1: rollout 9.000 s")
