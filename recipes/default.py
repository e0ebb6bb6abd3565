"""The embedded default: `tandem train` alone. Nothing is downloaded.

The tiny model (engine/testing/tiny_model.py: random weights, a tokenizer trained locally) gets a
short supervised warm start on single-digit addition ("3+4=" -> "7", operands 0-5), which leaves it right only
part of the time when it samples; then GRPO on two Ray engine actors in deterministic mode
(trainer and rollout logprobs equal bit for bit), pushing the weights every step, raises the
mean reward.
"""

from recipes.recipe import Recipe

RECIPE = Recipe(
    name="default",
    model="tiny",
    task="rollout.tasks:addition",
    task_args={"max_operand": 5},  # 36 problems: each recurs often enough for RL to learn it
    reward="rollout.rewards:exact_match",
    temperature=1.0,
    max_new_tokens=4,
    n_per_prompt=8,
    prompts_per_step=32,
    steps=50,
    lr=2e-3,
    warm_start_steps=8,  # partial reward (~0.3 on samples), which GRPO then raises
    warm_start_lr=3e-3,
    num_engines=2,
    engine_backend="ray",
    deterministic=True,
    seed=0,
    torch_threads=1,  # a tiny model: one thread wastes no time spinning on a small CPU
)
