"""EnginePool: a recipe's rollout engines, started in this process or as Ray actors.

Both kinds are engine.api.protocol EngineAPIs (an Engine, a RayClient), so the loop drives them
the same way. Engines run in deterministic mode when the recipe says so (batch-invariant kernels: the Policy recomputes
their logprobs bit for bit). Ray actors get a fractional GPU share when they are colocated with
the trainer, and none on the CPU.
"""

from __future__ import annotations

from typing import Any

from tandem.rl.model_source import ModelSource
from recipes.recipe import Recipe


def engine_kwargs(recipe: Recipe, source: ModelSource) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model_path": source.path, "load_format": source.load_format, "dtype": recipe.dtype,
        "device": recipe.device, "enable_deterministic_inference": recipe.deterministic,
        "random_seed": recipe.seed, "log_level": "warning",  # the run's table is the log
        # logprobs under the distribution the samples were drawn from (the Policy matches it)
        "logprob_distribution": "original" if recipe.temperature == 1.0 else "processed",
    }
    if recipe.routed_experts != "off":
        kwargs["enable_return_routed_experts"] = True
    kwargs["cuda_graph_max_bs"] = rollout_graph_max_bs(recipe)
    if recipe.lora_rank:  # LoRA RL: the engines serve the pushed adapter (one per engine)
        kwargs.update(enable_lora=True, max_lora_rank=recipe.lora_rank, lora_target_modules=recipe.lora_targets)
        if recipe.deterministic:  # the trainer's own LoRA code (the torch path): logprob diff 0 on a GPU too
            kwargs["lora_backend"] = "torch_native"
    kwargs.update(recipe.engine_args)
    return kwargs


def rollout_graph_max_bs(recipe: Recipe) -> int:
    """CUDA graphs up to the decode batch a rollout can reach (its samples; an engine gets at most
    all of them), not the engine's default 512: 19 graphs for the 0.6B recipe's 128 samples instead
    of 51 (seconds of start-up, and graph memory the trainer can use). A larger batch (never, in
    this loop) would decode eagerly, not wrongly."""
    samples = recipe.prompts_per_step * recipe.n_per_prompt
    return min(8 * -(-samples // 8), 512)


class EnginePool:
    def __init__(self, recipe: Recipe, source: ModelSource) -> None:
        self.recipe = recipe
        self.clients: list[Any] = []
        self._owns_ray = False
        kwargs = engine_kwargs(recipe, source)
        try:
            if recipe.engine_backend == "in_process":
                self._start_in_process(kwargs)
            else:
                self._start_ray(kwargs)
        except BaseException as exc:  # the engines started before the failure (or Ctrl-C) are shut down
            self.close()
            if isinstance(exc, Exception) and not isinstance(exc, (ValueError, OSError)):
                raise _start_error(exc) from exc
            raise

    def _start_in_process(self, kwargs: dict) -> None:
        from engine import Engine

        for _ in range(self.recipe.num_engines):
            self.clients.append(Engine(**kwargs))

    def _start_ray(self, kwargs: dict) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise SystemExit("engine_backend 'ray' needs Ray: pip install -e '.[rl]' "
                             "(or run with --engine-backend in_process)") from None
        from engine_client.engine_actor import ensure_ray, start_engine_actors
        from engine_client.ray_client import RayClient

        num_gpus = None
        if self.recipe.device != "cpu" and self.recipe.colocate:
            num_gpus = 1.0 / (self.recipe.num_engines + 1)  # the trainer holds a share of the same GPU
        self._owns_ray = ensure_ray()  # a failed start or Ctrl-C while actors load: close() ends Ray
        actors = start_engine_actors(self.recipe.num_engines, kwargs, num_gpus=num_gpus)
        self.clients = [RayClient(a, owns=True) for a in actors]

    def close(self) -> None:
        for client in self.clients:
            try:
                client.close()
            except Exception as exc:  # shutting down: report, keep closing the others
                print(f"warning: an engine did not shut down cleanly: {exc}")
        self.clients = []
        self._stop_ray()

    def _stop_ray(self) -> None:
        """The Ray cluster this pool started (not one it joined) ends with it: no raylet or
        worker outlives the run, whether it finished, failed or was interrupted."""
        if self._owns_ray:
            from engine_client.engine_actor import shutdown_ray

            shutdown_ray()  # Ctrl-C / SIGTERM still stop the rest of the run (the checkpoint)
            self._owns_ray = False

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _start_error(exc: Exception) -> ValueError:
    """An engine's start-up failed with an error no check names (say, a KV pool too large to
    allocate): one line, with what to look at."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return ValueError(f"the engines did not start: {type(exc).__name__}: {first} (check --engine-args and "
                      f"free memory; TANDEM_DEBUG=1 shows the traceback)")
