"""Trainer: the policy update of an RL step behind one interface, whatever runs the optimizer.

`Trainer` holds the step's math (micro batches, the RL objective, the supervised warm-start loss,
metrics); subclasses say how a loss goes backward, how the optimizer steps and how full weights
come out for the push: `TorchTrainer` here (plain AdamW, CPU or one GPU), `DeepSpeedTrainer` in
trainer_bridge/deepspeed.py (ZeRO-2/3, bf16, GPUs). Logprobs come from `Policy`, so in
deterministic mode they equal the engine's rollout logprobs bit for bit and the step reports
`logprob_abs_diff_max` == 0.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from trainer_bridge.losses import LossConfig, rl_objective
from trainer_bridge.policy import Policy
from trainer_bridge.rollout_batch import RolloutBatch
from trainer_bridge.train_flops import train_flops

NamedTensors = list[tuple[str, torch.Tensor]]


class Trainer(ABC):
    def __init__(self, policy: Policy, loss: LossConfig, micro_batch_size: int = 64,
                 temperature: Optional[float] = None) -> None:
        """temperature: the distribution the engine's logprobs are under (None: the original one)."""
        self.policy = policy
        self.loss = loss
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.reference: Optional[Policy] = None  # set by `freeze_reference` when kl_coef > 0
        self.replay_routes = False  # MoE: train on the rollout's routes (R3) when the batch has them

    # ---- what subclasses provide ----
    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def optimizer_step(self, lr: float) -> float:
        """Apply the accumulated gradients with learning rate lr; -> the gradient norm."""

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Forget the optimizer's state (between the warm start and RL)."""

    @abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> Iterable[NamedTensors]:
        """Full (unsharded) parameters, engine names, in runs of about bucket_bytes; a run is
        valid until the next one is drawn (ZeRO-3 gathers one at a time). A list when the runs
        are all resident (then the push knows the last one), else a generator."""

    # ---- the steps ----
    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current policy as the KL reference (after the warm start)."""
        self.reference = copy.deepcopy(self.policy).requires_grad_(False)

    def train_step(self, batch: RolloutBatch, lr: float) -> dict[str, float]:
        """One optimizer step on a rollout batch (gradients accumulated over micro batches)."""
        if not len(batch):
            raise ValueError("train_step got an empty batch (every response was empty)")
        # summed as device tensors and read once after the last backward: a read per micro batch
        # made the host wait for the device before it could prepare and queue the next one
        sums: dict[str, torch.Tensor] = {}
        routes_same = routes_total = 0
        for micro in batch.micro_batches(self.micro_batch_size):
            replay = micro.routed_experts if self.replay_routes else None
            logprobs = self.policy.rollout_logprobs(micro.prompts, micro.responses, self.temperature, replay)
            if micro.routed_experts is not None:
                same, total = self.policy.route_agreement(micro.prompts, micro.responses, micro.routed_experts)
                routes_same, routes_total = routes_same + same, routes_total + total
            ref = None
            if self.loss.kl_coef > 0:
                with torch.no_grad():
                    ref = self.reference_model().rollout_logprobs(micro.prompts, micro.responses, self.temperature)
            loss, metrics = rl_objective(logprobs, micro, self.loss, ref)
            self.backward(loss)
            _accumulate(sums, loss.detach(), metrics, micro.token_share)
        totals = {key: float(value) for key, value in zip(sums, torch.stack(list(sums.values())).tolist())}
        if not math.isfinite(totals["loss"]):  # before the step: the weights stay the last good ones
            for param in self.policy.parameters():
                param.grad = None  # nothing of this batch is left to add to the next
            raise FloatingPointError(f"the RL loss is {totals['loss']} (the step was not applied): "
                                     "lower the learning rate")
        if routes_total:  # the share of (token, layer, slot) routes the policy picks as the rollout did
            totals["route_agreement"] = routes_same / routes_total
        totals["grad_norm"] = self.optimizer_step(lr)
        totals["train_tflop"] = self.step_flops(batch) / 1e12
        return totals

    def step_flops(self, batch: RolloutBatch) -> float:
        """Matmul FLOPs of this batch's forward + backward (trainer_bridge/train_flops.py)."""
        lens = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
        return train_flops(self.policy.model, lens, sum(len(r) for r in batch.responses),
                           weight_grads=self.policy.lora is None)

    def supervised_step(self, prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                        lr: float) -> dict[str, float]:
        """One step of next-token cross-entropy on the target tokens (the warm start)."""
        total_tokens = sum(len(t) for t in targets)
        loss_sum = 0.0
        for start in range(0, len(prompts), self.micro_batch_size):
            sl = slice(start, start + self.micro_batch_size)
            logprobs = self.policy.rollout_logprobs(prompts[sl], targets[sl])
            loss = -torch.cat(logprobs).sum() / total_tokens
            self.backward(loss)
            loss_sum += loss.item()
        return {"loss": loss_sum, "grad_norm": self.optimizer_step(lr)}

    def save_hf_checkpoint(self, source_dir: str, out_dir: str) -> Path:
        """The current weights as an HF checkpoint (config and tokenizer copied from source_dir)."""
        from trainer_bridge.checkpoint import save_hf_checkpoint

        named = [(name, t.detach().to("cpu", copy=True)) for bucket in self.weight_buckets(1 << 30)
                 for name, t in bucket]
        return save_hf_checkpoint(self.policy.model, named, source_dir, out_dir)

    def reference_model(self) -> Policy:
        if self.reference is None:
            raise ValueError("kl_coef > 0 needs a reference: call freeze_reference() first")
        return self.reference


def _accumulate(sums: dict[str, torch.Tensor], loss: torch.Tensor, metrics: dict[str, torch.Tensor],
                token_share: float) -> None:
    """A micro batch's loss and metrics into the step's: the loss summed, the logprob gap's max
    kept (a NaN gap ignored, as Python's max(0.0, nan) did), the means weighted by the micro
    batch's share of the tokens. In float64, the precision of the Python floats these were."""
    zero = loss.new_zeros((), dtype=torch.float64)
    sums["loss"] = sums.get("loss", zero) + loss.double()
    sums["logprob_abs_diff_max"] = torch.fmax(sums.get("logprob_abs_diff_max", zero),
                                              metrics["logprob_abs_diff_max"].double())
    for key in ("logprob_abs_diff_mean", "tis_weight_mean", "clip_fraction", "kl"):
        sums[key] = sums.get(key, zero) + metrics.get(key, zero).double() * token_share


class TorchTrainer(Trainer):
    """AdamW on the Policy's parameters, on one device."""

    def __init__(self, policy: Policy, loss: LossConfig, micro_batch_size: int = 64,
                 temperature: Optional[float] = None, weight_decay: float = 0.0,
                 max_grad_norm: Optional[float] = 1.0) -> None:
        super().__init__(policy, loss, micro_batch_size, temperature)
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.reset_optimizer()

    def reset_optimizer(self) -> None:
        """Fresh AdamW moments: the RL phase must not inherit the warm start's gradient scale
        (its second moments decay over ~1000 steps and would shrink every RL update)."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=self.weight_decay)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, lr: float) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm else float("inf"))
        if not math.isfinite(float(norm)):  # a finite loss can still give inf/nan gradients
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"the gradient norm is {float(norm)} (the step was not applied): "
                                     "lower the learning rate")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def weight_buckets(self, bucket_bytes: int) -> Iterable[NamedTensors]:
        # Whole tensors already live here: one run; the push cuts its own buckets.
        return [[(name, p.detach()) for name, p in self.policy.model.named_parameters()]]
