"""GRPO on one GPU, colocated: a Ray engine actor and the DeepSpeed trainer share the device.

Each step the engine releases its memory while the trainer steps in it, takes the new weights
by CUDA IPC, then gets its KV cache back. By default the model is the Qwen3-0.6B shape with
random weights and a reward that varies whatever the weights (a speed, memory and exactness
check, not learning); point it at a real HF checkpoint, a real task and its reward to train:

    tandem train --recipe qwen3_gpu --model /path/to/Qwen3-0.6B --steps 200 --task my_pkg.tasks:gsm8k \\
        --reward my_pkg.rewards:gsm8k_correct --max-new-tokens 1024

Memory: the trainer keeps its ZeRO states (fp32 master weights and Adam moments, ~16 bytes a
parameter) while the engine generates, and its cached activations too where the device has room
for both (trainer_bridge/colocate.py, LentMemory), so the engine's share must leave room for them: on one
H200 the Qwen3-4B shape ran with `--engine-args '{"mem_fraction_static": 0.25,
"enable_memory_saver": true}'` (106.6 GiB peak; docs/benchmarks.md).
The engine's CUDA graphs survive each release (their memory pool is unmapped and mapped back at
the same addresses), so no step re-captures them; `--keep-cuda-graphs true` keeps the pool
mapped through the step.
"""

from recipes.recipe import Recipe

RECIPE = Recipe(
    name="qwen3_gpu",
    model="qwen3-0.6b",  # a preset (random weights) or an HF checkpoint directory
    dtype="bfloat16",
    device="cuda",
    task="rollout.tasks:addition",
    reward="rollout.rewards:response_parity",  # varies on random weights, so every step updates the policy
    temperature=1.0,
    max_new_tokens=256,
    n_per_prompt=8,
    prompts_per_step=16,
    steps=5,
    lr=1e-6,
    # H200 (docs/benchmarks.md): micro 64 trains in 0.57-0.75 s (normal) / 1.87-1.96 s (deterministic), trainer
    # peak 33.7 / 35.3 GiB; micro 32 took 0.75-1.16 / 2.25-2.58 s at 33.7 / 38.2 GiB
    micro_batch_size=64,
    warm_start_steps=0,
    num_engines=1,
    engine_backend="ray",
    engine_args={"mem_fraction_static": 0.35, "enable_memory_saver": True},  # released memory is really freed
    trainer="deepspeed",
    zero_stage=2,  # one GPU: ZeRO-3 partitions nothing, and its gathers cost time and 0.9 GiB
    colocate=True,
    transport="tensor",  # CUDA IPC from the trainer into the engine actor
    bucket_bytes=1 << 30,
    deterministic=True,
)
