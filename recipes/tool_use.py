"""Toy tool use: the model calls a calculator mid-answer (recipes/calculator_tool.py).

Multi-turn rollouts through the `calculator_rollout` plug-in: the calculator's tokens are in the
context but have loss mask 0, so only the model's own tokens are trained on.
"""

from recipes.recipe import Recipe

RECIPE = Recipe(
    name="tool_use",
    model="tiny",
    task="recipes.calculator_tool:calculator_addition",
    reward="rollout.rewards:exact_match",
    rollout_fn="recipes.calculator_tool:calculator_rollout",
    max_new_tokens=6,
    n_per_prompt=8,
    prompts_per_step=16,
    steps=20,
    lr=1e-3,
    warm_start_steps=20,
    warm_start_lr=3e-3,
    num_engines=2,
    engine_backend="ray",
    deterministic=True,
    torch_threads=1,
)
