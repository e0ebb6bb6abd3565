"""Where the qwen3_gpu recipe's train phase spends its time, and its share of the bf16 peak (GPU).

Builds the recipe's trainer (DeepSpeed, bf16, Qwen3-0.6B shape, random weights) on a synthetic
rollout batch of the recipe's size (16 prompts x 8 samples, 24-token prompts, 256-token responses),
times train steps and prints the top CUDA kernels of one profiled step. Variants: ZeRO stage, and
`--normal-mode` (the normal-mode trainer's Policy: cuBLAS linears, torch ops under autograd, flash
attention; without it deterministic mode's batch-invariant kernels, the engine's bits).
FLOPs counted as `tandem train` counts them (trainer_bridge/train_flops.py: 6 per weight per token
but the embedding's, the LM head's over the response rows, causal attention), against 790 TFLOP/s.
Until 2026-12-04 (4f49991) this script counted 6 x all parameters x all tokens: 132 TFLOP for
the recipe's batch, 2.2% more than the 128.8 counted now.
Usage: python scripts/train_step_profile.py [--zero-stage 3] [--normal-mode] [--steps 3] [--profile]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

PEAK_TFLOPS = 790.0


def synthetic_batch(samples: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from trainer_bridge.rollout_batch import RolloutBatch

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(samples)]
    responses = [[rng.randrange(10, vocab) for _ in range(response_len)] for _ in range(samples)]
    return RolloutBatch(prompts, responses, [[1] * response_len for _ in range(samples)],
                        [[-2.0] * response_len for _ in range(samples)],
                        [rng.choice((-1.0, 1.0)) for _ in range(samples)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--normal-mode", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trainer", choices=("deepspeed", "torch"), default="deepspeed")  # torch: a CPU smoke run
    parser.add_argument("--response-len", type=int, default=256)
    args = parser.parse_args()
    from tandem.rl.model_source import ModelSource
    from trainer_bridge.deepspeed import DeepSpeedTrainer
    from trainer_bridge.losses import LossConfig

    source = ModelSource.resolve(args.model)
    if args.trainer == "deepspeed":
        trainer = DeepSpeedTrainer.from_pretrained(source.path, LossConfig(), zero_stage=args.zero_stage,
                                                   load_format=source.load_format,
                                                   micro_batch_size=args.micro_batch_size,
                                                   batch_invariant=not args.normal_mode)
    else:
        from trainer_bridge.policy import Policy
        from trainer_bridge.trainer import TorchTrainer

        policy = Policy.from_pretrained(source.path, torch.float32, "cpu", source.load_format,
                                        batch_invariant=not args.normal_mode)
        trainer = TorchTrainer(policy, LossConfig(), args.micro_batch_size)
    model = trainer.policy.model
    batch = synthetic_batch(128, 24, args.response_len, model.config.vocab_size)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    flops = trainer.step_flops(batch)
    trainer.train_step(batch, 1e-6)  # warm-up: compiles, allocator
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.train_step(batch, 1e-6)
        sync()
        times.append(time.perf_counter() - start)
    med = sorted(times)[len(times) // 2]
    print(f"zero {args.zero_stage} normal_mode {args.normal_mode} micro {args.micro_batch_size}: train step "
          f"median {med:.2f} s ({', '.join(f'{t:.2f}' for t in times)}); {flops / 1e12:.0f} TFLOP -> "
          f"{flops / med / 1e12:.0f} TFLOP/s = {100 * flops / med / 1e12 / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS:.0f}; "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0:.1f} GiB", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(batch, 1e-6)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
