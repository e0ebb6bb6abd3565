"""DeepSpeedTrainer: the Trainer interface on a DeepSpeed ZeRO-2/3 engine (bf16), on GPUs.

The Policy (batch-invariant kernels, so its logprobs equal a deterministic engine's) is wrapped by
`deepspeed.initialize` with a torch AdamW as the client optimizer (no fused-op build needed).
Gradient accumulation over the step's micro batches is ours: every micro batch's loss is already
its share of the batch's, the accumulation boundary is set by hand on the last one, and the
engine's own accumulation count stays 1 (so DeepSpeed never rescales the loss).

Weights for the push: ZeRO-2 keeps full bf16 parameters on every rank, so buckets are views;
ZeRO-3 partitions them, so each bucket is gathered (`GatheredParameters`) only while it is being
pushed and released before the next one: the full model is never resident twice.

One process here (rank 0 of a world of 1 unless the launcher set one); deepspeed is imported
inside, so the rest of tandem never needs it.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Iterable, Iterator, Optional

import torch

from trainer_bridge.losses import LossConfig
from trainer_bridge.policy import Policy
from trainer_bridge.trainer import NamedTensors, Trainer
from weight_sync.bucket import split_by_bytes


class DeepSpeedTrainer(Trainer):
    def __init__(self, policy: Policy, loss: LossConfig, zero_stage: int = 2, micro_batch_size: int = 64,
                 temperature: Optional[float] = None, max_grad_norm: Optional[float] = 1.0,
                 weight_decay: float = 0.0) -> None:
        if zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {zero_stage}")
        try:
            import deepspeed
        except ImportError:
            raise SystemExit("trainer 'deepspeed' needs DeepSpeed: pip install -e '.[rl]'") from None
        super().__init__(policy, loss, micro_batch_size, temperature)
        self.zero_stage = zero_stage
        _init_single_process_group(deepspeed)
        dtype = next(policy.parameters()).dtype
        config = {
            "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": max_grad_norm or 0.0,
            "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16},
            "zero_optimization": {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-6,
                                      weight_decay=weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
        if zero_stage == 3:
            _register_borrowed_parameters(policy)
        self._micro_left = 0

    @classmethod
    def from_pretrained(cls, model_path: str, loss: LossConfig, zero_stage: int = 2,
                        dtype: torch.dtype = torch.bfloat16, device: str = "cuda", load_format: str = "auto",
                        attention_backend: Optional[str] = None, batch_invariant: bool = True,
                        **kwargs) -> "DeepSpeedTrainer":
        if not str(device).startswith("cuda"):
            raise ValueError("the DeepSpeed trainer runs on CUDA; on the CPU use trainer 'torch'")
        policy = Policy.from_pretrained(model_path, dtype, device, load_format, attention_backend=attention_backend,
                                        batch_invariant=batch_invariant)
        return cls(policy, loss, zero_stage, **kwargs)

    # ---- accumulation: the boundary is the last micro batch of a step ----
    def train_step(self, batch, lr: float) -> dict[str, float]:
        self._micro_left = len(range(0, len(batch), self.micro_batch_size))
        return super().train_step(batch, lr)

    def supervised_step(self, prompts, targets, lr: float) -> dict[str, float]:
        self._micro_left = len(range(0, len(prompts), self.micro_batch_size))
        return super().supervised_step(prompts, targets, lr)

    def backward(self, loss: torch.Tensor) -> None:
        self._micro_left -= 1
        self.engine.set_gradient_accumulation_boundary(self._micro_left <= 0)
        self.engine.backward(loss)

    def optimizer_step(self, lr: float) -> float:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()
        applied = getattr(self.engine, "was_step_applied", lambda: True)()
        if not applied:  # DeepSpeed >= 0.17 skips a step with inf/nan gradients (bf16 check_grad_overflow)
            raise FloatingPointError("the optimizer skipped this step: the gradients were not finite (the weights "
                                     "are unchanged): lower the learning rate")
        norm = self.engine.get_global_grad_norm()
        if norm is None:  # not computed by this configuration
            return float("nan")
        if not math.isfinite(float(norm)):  # an older DeepSpeed steps anyway: stop before these weights are pushed
            raise FloatingPointError(f"the gradient norm is {float(norm)} (the step was applied; the run stops "
                                     "before these weights reach the engines): lower the learning rate")
        return float(norm)

    def reset_optimizer(self) -> None:
        raise ValueError("the DeepSpeed trainer has no warm start: GPU recipes start from a checkpoint "
                         "(set warm_start_steps 0)")

    def freeze_reference(self) -> None:
        raise ValueError("kl_coef > 0 is not supported with the DeepSpeed trainer yet (set kl_coef 0)")

    # ---- weights out ----
    def weight_buckets(self, bucket_bytes: int) -> Iterable[NamedTensors]:
        named = list(self.policy.model.named_parameters())
        if self.zero_stage < 3:
            return [[(n, p.detach()) for n, p in named]]  # full parameters live here; the push cuts buckets
        return self._gathered(named, bucket_bytes)

    @staticmethod
    def _gathered(named: list, bucket_bytes: int) -> Iterator[NamedTensors]:
        """ZeRO-3: one run of full parameters at a time, valid until the next is drawn."""
        import deepspeed

        full_bytes = lambda p: getattr(p, "ds_numel", p.numel()) * p.element_size()  # noqa: E731 (ZeRO-3: ds_numel)
        for group in split_by_bytes(named, bucket_bytes, full_bytes):
            params = [p for _, p in group]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield [(n, p.data) for n, p in group]


def _register_borrowed_parameters(model: torch.nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters when that module's forward runs. Attention reads its
    q/k norms' weights itself (one fused norm + rope kernel; their forwards never run), and a MoE
    block its stacked experts' (one fused MoE kernel), so they are registered as that module's
    own: gathered for its forward and backward."""
    import deepspeed  # deepspeed.zero is an attribute of the package, not an importable module

    for module in model.modules():
        borrowed = []
        if getattr(module, "qk_norm", False):
            borrowed += [module.q_norm.weight, module.k_norm.weight]
        if hasattr(module, "borrowed_parameters"):
            borrowed += module.borrowed_parameters()
        for param in borrowed:
            deepspeed.zero.register_external_parameter(module, param)


def _init_single_process_group(deepspeed) -> None:
    """A world of one unless a launcher (deepspeed, torchrun) already set RANK/WORLD_SIZE."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="nccl")
