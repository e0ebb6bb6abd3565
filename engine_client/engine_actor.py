"""EngineActor: a Ray actor that owns one Engine (and optionally its HTTP server).

The Engine is created inside the actor, on the GPU share Ray gave it (`num_gpus` may be
fractional, so a colocated trainer actor shares the GPU; 0 on the CPU). Every Engine method is
reached through one actor method, `call(name, *args, **kwargs)` (RayClient builds the calls), so
a method added to Engine reaches Ray callers with no edit here. The actor is an async actor:
`call` is a coroutine on one event loop; a method with an async form (generate ->
async_generate) is awaited there, so many generates run at once, and every other Engine call
(pause, weight updates, release) runs on a worker thread, so it never stalls the generates.

Weight payloads arrive by reference: CPU tensors through Ray's object store (shared memory; pass
an ObjectRef from `ray.put` to reach several engines with one copy), or
`weight_sync.cuda_ipc.serialize` bytes (CUDA IPC handles from a colocated trainer, shared-memory
descriptors on the CPU), passed on as they are to Engine.update_weights_from_tensor: the
engine's core unpickles them through the allowlist. `start_engine_actors` starts a local Ray
cluster if none runs.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

MAX_CONCURRENT_CALLS = 16384  # Ray's default for async actors (1000) would queue a large rollout batch
ACTOR_METHODS = ("serve_http", "shutdown")  # the actor's own: it holds the HTTP server beside the engine


class EngineActor:
    """Ray turns this into an actor with `ray.remote(EngineActor)` (see engine_actor_class).
    engine_class: an Engine subclass to run instead (its added methods are reached the same way)."""

    def __init__(self, engine_kwargs: dict, engine_class: Any = None) -> None:
        if engine_class is None:
            from engine import Engine as engine_class

        self.engine = engine_class(**engine_kwargs)
        try:  # the actor's process is ours: its start-up objects are never scanned again
            self.engine.freeze_gc()
        except BaseException:
            self.engine.shutdown()
            raise
        self._http: Optional[tuple[Any, threading.Thread]] = None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Engine.<method>(*args, **kwargs), or the actor's own serve_http / shutdown. A
        ValueError from a method that answers (success, message) comes back as (False, message)
        ((False, message, 0) from update_weights_from_disk), a refusal the caller reads, as over HTTP."""
        if method in ACTOR_METHODS:
            return await getattr(self, method)(*args, **kwargs)
        from engine.api.protocol import answers_reply, refusal

        target = _public_method(self.engine, method)
        try:
            return await self._run(method, target, args, kwargs)
        except ValueError as exc:
            if not answers_reply(target):
                raise
            return refusal(target, str(exc))

    async def _run(self, method: str, target: Any, args: tuple, kwargs: dict) -> Any:
        """On this loop: the method's async form when Engine has one, or an async_ method itself;
        anything else on a worker thread (it may block: a weight update, a pause)."""
        concurrent = target if method.startswith("async_") else getattr(self.engine, f"async_{method}", None)
        if concurrent is None:
            return await asyncio.to_thread(target, *args, **kwargs)
        result = concurrent(*args, **kwargs)
        if hasattr(result, "collect"):  # a generate's stream: its final outputs (a Ray call cannot stream)
            return await result.collect()
        return await result if inspect.isawaitable(result) else result

    # ---- HTTP and lifetime ---------------------------------------------------------------------
    async def serve_http(self, host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
                         admin_api_key: Optional[str] = None) -> str:
        """Serve SGLang's routes for this engine on a thread (port 0: a free one) -> its URL.
        Keys as `tandem serve --api-key / --admin-api-key`."""
        if self._http is not None:
            raise ValueError("this engine actor already serves HTTP; one server per engine")
        import socket

        import uvicorn

        from engine.server.http import create_app

        sock = socket.socket()
        sock.bind((host, port))  # bound here so the URL is known before the server runs
        app = create_app(self.engine, api_key=api_key, admin_api_key=admin_api_key)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="engine-http", daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the HTTP server on {host}:{sock.getsockname()[1]} did not start (see the log)")
            await asyncio.sleep(0.02)
        self._http = (server, thread)
        return f"http://{host}:{sock.getsockname()[1]}"

    async def shutdown(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.should_exit = True
            await asyncio.to_thread(thread.join, 10.0)
            self._http = None
        await asyncio.to_thread(self.engine.shutdown)


def _public_method(engine: Any, name: str) -> Any:
    method = None if name.startswith("_") else getattr(engine, name, None)
    if not callable(method):
        raise AttributeError(f"{type(engine).__name__} has no public method {name!r}")
    return method


def engine_actor_class() -> Any:
    """EngineActor as a Ray actor class (ray imported here, so the CPU path works without it)."""
    import ray

    return ray.remote(EngineActor)


def ensure_ray(num_cpus: Optional[int] = None, **init_kwargs: Any) -> bool:
    """Join the Ray cluster this process is in, or start a light local one (no dashboard).
    -> True when this call started it (the caller may then shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    with _signals_held():
        ray.init(include_dashboard=False, num_cpus=num_cpus, configure_logging=False, **init_kwargs)
    return True


@contextmanager
def _signals_held() -> Iterator[None]:
    """ray.init starts the GCS, raylet and agents as child processes; a Ctrl-C midway leaves some
    running with no owner (ray.shutdown does not know them yet). So SIGINT is held while it runs
    and delivered after it returns, Ray shut down first. SIGTERM too when the caller handles it
    (`tandem train` does): then Ray's own SIGTERM handlers (Python's sys.exit in its Node, a C++
    stack dump in its core worker) are kept out and the caller's is put back after ray.init."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    held: list[int] = []
    caught = [signal.SIGINT] + ([signal.SIGTERM] if callable(signal.getsignal(signal.SIGTERM)) else [])
    previous = {s: signal.getsignal(s) for s in caught}
    ray_sets_sigterm = getattr(ray_utils, "set_sigterm_handler", None)
    for s in caught:
        signal.signal(s, lambda signum, frame: held.append(signum))
    if signal.SIGTERM in caught and ray_sets_sigterm is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if ray_sets_sigterm is not None:
            ray_utils.set_sigterm_handler = ray_sets_sigterm
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if held:
        shutdown_ray()
        signal.raise_signal(held[0])


def shutdown_ray() -> None:
    """ray.shutdown, with this process's Ctrl-C / SIGTERM handlers working again after it."""
    import ray

    ray.shutdown()
    reassert_signal_handlers()


def reassert_signal_handlers() -> None:
    """ray.shutdown (its C++ core worker) resets SIGTERM's disposition under Python's feet: the
    Python handler is still named by signal.getsignal but a SIGTERM kills the process. Setting the
    handlers again makes them real (main thread only; default handlers are left as they are)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(s)
        if callable(handler):
            signal.signal(s, handler)


def colocation_group(n: int, gpus_per_bundle: float = 1, cpus_per_bundle: float = 1,
                     timeout_s: float = 300.0) -> Any:
    """A Ray placement group of n bundles, each one GPU (or, with gpus_per_bundle=0, CPUs only):
    engine i and the trainer rank that shares its GPU both go into bundle i, so fractional
    num_gpus lands them on the same device even on a node with several GPUs."""
    ensure_ray()
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus_per_bundle, **({"GPU": gpus_per_bundle} if gpus_per_bundle else {})}
    group = placement_group([bundle] * n, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise TimeoutError(f"{n} bundles of {bundle} could not be reserved in {timeout_s:.0f} s "
                           f"(ray.available_resources() = {ray.available_resources()})") from None
    return group


def in_bundle(group: Any, index: int) -> dict:
    """Actor options that put it into bundle `index` of a colocation_group (none without one)."""
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def start_engine_actors(n: int, engine_kwargs: dict, num_gpus: Optional[float] = None,
                        num_cpus: float = 0, start_timeout_s: float = 900.0,
                        placement_group: Any = None, engine_class: Any = None) -> list[Any]:
    """n engine actors, each owning an Engine(**engine_kwargs), ready when this returns.
    num_gpus: Ray's GPU share per actor (fractional to colocate with a trainer); None: 1 when
    the engine runs on a GPU (device "cuda", or "auto" on a cluster with GPUs), else 0.
    num_cpus: Ray's CPU accounting per actor (0: the engines do not take CPU slots a small
    machine needs for trainer actors). For SGLang-route clients,
    `ray.get(actor.serve_http.remote())` gives an actor's URL. An engine not up within
    start_timeout_s (loading included) is an error, never a hang. placement_group: a
    colocation_group; engine i goes into its bundle i. engine_class: an Engine subclass to run."""
    if n < 1:
        raise ValueError(f"start_engine_actors needs n >= 1, got {n}")
    ensure_ray()
    import ray

    if num_gpus is None:
        device = engine_kwargs.get("device", "auto")
        num_gpus = 0 if device == "cpu" or device == "auto" and not ray.cluster_resources().get("GPU") else 1

    cls = engine_actor_class()
    options = {"num_gpus": num_gpus, "num_cpus": num_cpus, "max_concurrency": MAX_CONCURRENT_CALLS}
    actors = [cls.options(**options, **in_bundle(placement_group, i)).remote(dict(engine_kwargs), engine_class)
              for i in range(n)]
    wait_until_ready([a.call.remote("health") for a in actors], actors, start_timeout_s,
                     f"{n} engine actor(s) with num_gpus={num_gpus}, num_cpus={num_cpus}")
    return actors


def wait_until_ready(refs: list, actors: list, timeout_s: float, what: str) -> None:
    """ray.get of start-up probes: a failed start-up raises its error here; one that never gets
    scheduled (the cluster lacks the resources) or hangs is killed after timeout_s."""
    import ray

    try:
        ray.get(refs, timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:  # one engine's start-up raised: that error, as in-process
        for actor in actors:
            ray.kill(actor)
        raise _creation_error(exc) from exc
    except ray.exceptions.GetTimeoutError:
        for actor in actors:
            ray.kill(actor)
        raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s: does the Ray cluster have those resources "
                           f"free (ray.available_resources() = {ray.available_resources()})?") from None


def _creation_error(exc: Exception) -> BaseException:
    """The exception an actor's __init__ raised (Ray wraps it in a RayTaskError inside an
    ActorDiedError), else the Ray error itself."""
    task_error = exc.args[0] if exc.args else None
    cause = getattr(task_error, "cause", None)
    return cause if isinstance(cause, Exception) else exc
