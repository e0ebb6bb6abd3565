"""`tandem bench-sync`: how long a full weight update takes, phase by phase, and what it costs in memory.

One update is the RL protocol end to end: pause (retract) -> transfer (the trainer's buckets reach
the engine process: IPC handles / shared-memory names, or a checkpoint written to disk) -> load
(every bucket into the parameters; for cuda-ipc this includes the core opening the handles, as
every serialized payload is opened where it loads) -> flush (the radix cache) + new weight version
-> resume.
Each phase's median over --num-updates updates is reported, with GPU memory before the first and
after the last update (growth in %, so --num-updates 200 shows whether buffers are reused), and
whether the engine then holds the trainer's weights.

Transports: inprocess (the trainer's buckets are in this process), cuda-ipc (a trainer in another
process: a Ray actor if Ray is installed, else a spawned process; on the CPU the same path carries
shared memory), disk (safetensors written by the trainer, read by update_weights_from_disk), nccl
(a spawned trainer process, rank 0 of a weight group, broadcasts one flattened bucket at a time;
on GPUs it takes the second GPU, NCCL; on the CPU, gloo: tandem/group_trainer.py). For nccl,
transfer runs until the last bucket reached the engine and load is what follows (the engine loads
each bucket while the next one is on the wire, so earlier loads hide inside the transfer).
Real-shape presets load random weights (--load-format dummy): only the timing matters here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

import torch

PHASES = ("pause", "transfer", "load", "flush", "resume")
TRANSPORTS = ("inprocess", "cuda-ipc", "disk", "nccl")
GROUP_NAME = "bench-sync"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.preset_model import add_preset_argument
    from tandem.server_args import add_server_args

    g = p.add_argument_group("bench-sync")
    add_preset_argument(g)
    g.add_argument("--transport", choices=TRANSPORTS, default="inprocess")
    g.add_argument("--num-updates", type=int, default=5, help="updates measured (medians need >= 5)")
    g.add_argument("--bucket-mb", type=float, default=1024, help="flattened bucket size (MiB)")
    g.add_argument("--trainer", choices=("auto", "ray", "process"), default="auto",
                   help="cuda-ipc: where the trainer runs (auto: a Ray actor if Ray is installed)")
    g.add_argument("--trainer-device", default=None,
                   help="nccl: the trainer's device (default: cuda:1 beside an engine on a GPU, else cpu)")
    g.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="push a rank-R LoRA adapter (targets: --lora-target-modules, default all linears) "
                   "instead of the full weights: unload + load_lora_adapter_from_tensors, as LoRA RL syncs")
    g.add_argument("--lora-load-format", choices=("flattened_bucket", "direct"), default="flattened_bucket",
                   help="--lora-rank: the adapter as one flattened bucket or as (name, tensor) pairs")
    g.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    add_server_args(p, require_model_path=False)


def run_bench_sync(args: argparse.Namespace) -> int:
    from engine import Engine
    from tandem.preset_model import engine_kwargs_from_args

    if args.num_updates < 1 or args.lora_rank < 0:
        raise SystemExit("tandem bench-sync: --num-updates must be >= 1 and --lora-rank >= 0")
    if args.lora_rank:
        from tandem.bench_sync_lora import format_lora_report, run_lora_push

        return _write_report(run_lora_push(args), format_lora_report, args.json_path)
    kwargs, label = engine_kwargs_from_args(args, "bench-sync")
    if _on_gpu(kwargs) and kwargs.get("mem_fraction_static") is None and args.transport != "nccl":
        kwargs["mem_fraction_static"] = 0.5  # leave room for the colocated trainer's weights
    engine = Engine(**kwargs)
    trainer = None
    try:
        trainer = start_trainer(args, engine)
        report = measure(engine, trainer, args.transport, args.num_updates)
    finally:
        if trainer is not None:
            trainer.stop()
        engine.shutdown()
    report.update(model=label, transport=args.transport, trainer=getattr(trainer, "kind", None),
                  bucket_mb=args.bucket_mb, device=engine.info.device, dtype=engine.info.dtype, **trainer.layout)
    return _write_report(report, format_report, args.json_path)


def _write_report(report: dict, formatter: Callable[[dict], str], json_path: Optional[str]) -> int:
    print(formatter(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _on_gpu(kwargs: dict) -> bool:
    device = kwargs.get("device", "auto")
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


class LocalTrainer:
    """The trainer in this process (inprocess and disk transports)."""
    kind = "inprocess"

    def __init__(self, trainer_cls: Optional[type] = None, **kwargs: Any) -> None:
        from tandem.sync_trainer import BucketTrainer

        self.trainer = (trainer_cls or BucketTrainer)(**kwargs)
        self.layout = self.trainer.layout()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.trainer, method)(*args)

    def stop(self) -> None:
        pass


def start_trainer(args: argparse.Namespace, engine: Any, trainer_cls: Optional[type] = None, **extra: Any) -> Any:
    """The trainer where --transport puts it: this process, a spawned one or a Ray actor (cuda-ipc),
    or a weight group's rank 0 (nccl). trainer_cls: BucketTrainer unless given; extra: its kwargs."""
    from tandem import sync_trainer

    kwargs = dict(model_path=engine.info.model_path, dtype=engine.info.dtype, device=engine.info.device, **extra)
    if trainer_cls is None:
        trainer_cls = sync_trainer.BucketTrainer
        kwargs["bucket_bytes"] = int(args.bucket_mb * 2**20)
    if args.transport == "nccl":
        return _start_group_trainer(args, engine, kwargs)
    if args.transport != "cuda-ipc":
        return LocalTrainer(trainer_cls, **kwargs)
    use_ray = args.trainer == "ray" or (args.trainer == "auto" and _ray_installed())
    if use_ray:
        trainer = sync_trainer.TrainerActor(num_gpus=0.5 if engine.info.device.startswith("cuda") else 0,
                                            trainer_cls=trainer_cls,
                                            **dict(kwargs, device="cuda" if "cuda" in kwargs["device"] else "cpu"))
    else:
        trainer = sync_trainer.TrainerProcess(trainer_cls, **kwargs)
    trainer.kind = "ray" if use_ray else "process"
    return trainer


def _start_group_trainer(args: argparse.Namespace, engine: Any, kwargs: dict) -> Any:
    """The trainer process forms the group as rank 0 while this engine joins as rank 1."""
    import socket

    from tandem.group_trainer import GroupTrainerProcess

    on_gpu = engine.info.device.startswith("cuda")
    if on_gpu and args.trainer_device is None and torch.cuda.device_count() < 2:
        raise SystemExit("tandem bench-sync --transport nccl: the trainer needs a second GPU (NCCL refuses two "
                         "ranks on one GPU); only one is visible")
    device = args.trainer_device or ("cuda:1" if on_gpu else "cpu")
    if on_gpu and torch.device(device) == torch.device(engine.info.device):
        raise SystemExit("tandem bench-sync --transport nccl: the trainer needs a GPU of its own (NCCL refuses "
                         "two ranks on one GPU); pass --trainer-device cuda:N")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if on_gpu else "gloo"
    group_args = dict(master_address="127.0.0.1", master_port=port, world_size=2, group_name=GROUP_NAME,
                      backend=backend, timeout_s=120.0)
    trainer = GroupTrainerProcess(group_args, **dict(kwargs, device=device))
    try:
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP_NAME, backend=backend,
                                                       timeout_s=120.0)
        if not ok:
            raise RuntimeError(f"the engine did not join the weight group: {message}")
        trainer.joined(120.0)
        trainer.specs = trainer.call("bucket_specs")
    except BaseException:
        trainer.stop()
        raise
    return trainer


def _ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def measure(engine: Any, trainer: Any, transport: str, num_updates: int) -> dict[str, Any]:
    """Runs the updates; -> medians per phase, per-update totals, memory and the weight check."""
    step = {"inprocess": _inprocess_step, "cuda-ipc": _ipc_step, "disk": _disk_step, "nccl": _nccl_step}[transport]
    memory = {"before": gpu_memory(engine)}
    updates = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-sync-") as scratch:
        for i in range(num_updates):
            updates.append(_one_update(engine, lambda: step(engine, trainer, scratch), f"bench-{i + 1}"))
            trainer.call("ipc_collect")
            if i == 0:
                memory["after_first"] = gpu_memory(engine)
    memory["after"] = gpu_memory(engine)
    medians = {p: statistics.median(u[p] for u in updates) for p in (*PHASES, "total")}
    return {"num_updates": num_updates, "median_s": medians, "updates_total_s": [u["total"] for u in updates],
            "memory": memory_report(memory), "weights_match_trainer": _weights_match(engine, trainer),
            "weight_version": engine.get_weight_version()}


def _one_update(engine: Any, transfer_and_load: Callable[[], tuple[float, float]], version: str) -> dict:
    sync = synchronizer(engine)
    start = time.perf_counter()
    engine.pause_generation(mode="retract")
    paused = time.perf_counter()
    transfer, load = transfer_and_load()
    loaded = time.perf_counter()
    engine.flush_cache()
    engine.update_weight_version(version)
    flushed = time.perf_counter()
    engine.continue_generation()
    sync()
    end = time.perf_counter()
    return {"pause": paused - start, "transfer": transfer, "load": load, "flush": flushed - loaded,
            "resume": end - flushed, "total": end - start}


def _inprocess_step(engine: Any, trainer: Any, scratch: str) -> tuple[float, float]:
    start = time.perf_counter()
    buckets = trainer.trainer.buckets
    mid = time.perf_counter()
    _load_buckets(engine, [b.to_payload() for b in buckets])
    return mid - start, time.perf_counter() - mid


def _ipc_step(engine: Any, trainer: Any, scratch: str) -> tuple[float, float]:
    """The payloads go to the engine serialized: its core opens the handles (a core process
    included) and closes its mappings after each bucket; the trainer's ipc_collect frees its side."""
    start = time.perf_counter()
    payloads = trainer.call("payloads")
    mid = time.perf_counter()
    _load_buckets(engine, payloads)
    return mid - start, time.perf_counter() - mid


def _disk_step(engine: Any, trainer: Any, scratch: str) -> tuple[float, float]:
    from safetensors.torch import save_file

    start = time.perf_counter()
    named = trainer.call("named_tensors")
    save_file({n: t.contiguous().cpu() for n, t in named}, f"{scratch}/model.safetensors")
    mid = time.perf_counter()
    ok, message, _ = engine.update_weights_from_disk(scratch, flush_cache=False)
    if not ok:
        raise RuntimeError(f"disk update refused: {message}")
    return mid - start, time.perf_counter() - mid


def _nccl_step(engine: Any, trainer: Any, scratch: str) -> tuple[float, float]:
    """The trainer broadcasts every bucket while this process asks the engine to receive each."""
    start = time.monotonic()
    trainer.start("broadcast")
    for specs in trainer.specs:
        names, dtypes, shapes = (list(x) for x in zip(*specs))
        ok, message = engine.update_weights_from_distributed(names, dtypes, shapes, GROUP_NAME, flush_cache=False,
                                                             load_format="flattened_bucket")
        if not ok:
            raise RuntimeError(f"bucket refused: {message}")
    end = time.monotonic()
    # the trainer's clock reading after its last send can trail the engine's load on a busy CPU
    # (the same monotonic clock: both processes are on this host); the load is then ~0, not < 0
    last_sent = min(trainer.result(), end)
    return last_sent - start, end - last_sent


def _load_buckets(engine: Any, payloads: list) -> None:
    for payload in payloads:
        ok, message = engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
        if not ok:
            raise RuntimeError(f"bucket refused: {message}")


def synchronizer(engine: Any) -> Callable[[], None]:
    if engine.info.device.startswith("cuda"):
        return lambda: torch.cuda.synchronize()
    return lambda: None


def gpu_memory(engine: Any) -> Optional[dict[str, float]]:
    """Device-wide used bytes (the trainer's process included) and this process's allocations."""
    if not engine.info.device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"device_used_gb": (total - free) / 2**30, "process_reserved_gb": torch.cuda.memory_reserved() / 2**30}


def memory_report(memory: dict) -> Optional[dict]:
    """Growth is counted from after the first update (the first one may leave allocator caches)."""
    if memory["before"] is None:
        return None
    first, last = memory["after_first"]["device_used_gb"], memory["after"]["device_used_gb"]
    return {**memory, "device_growth_pct": 100.0 * (last - first) / max(first, 1e-9)}


def _weights_match(engine: Any, trainer: Any, rows: int = 2) -> bool:
    """The engine's first rows of the first and last tensor equal the trainer's (in float32)."""
    names = trainer.call("tensor_names")
    for name in (names[0], names[-1]):
        ours = torch.tensor(engine.get_weights_by_name(name, truncate_size=rows), dtype=torch.float32)
        theirs = torch.tensor(trainer.call("first_rows", name, rows), dtype=torch.float32)
        if ours.shape != theirs.shape or not torch.equal(ours, theirs):
            return False
    return True


def format_report(r: dict[str, Any]) -> str:
    lines = [f"tandem bench-sync: {r['model']} ({r['device']}, {r['dtype']}), transport {r['transport']}"
             + (f" (trainer: {r['trainer']})" if r.get("trainer") else ""),
             f"  {r['num_tensors']} tensors, {r['total_bytes'] / 2**30:.2f} GiB in {r['num_buckets']} buckets "
             f"of <= {r['bucket_mb']:.0f} MiB; {r['num_updates']} updates",
             "  median (ms): " + "  ".join(f"{p} {r['median_s'][p] * 1e3:.1f}" for p in (*PHASES, "total"))]
    mem = r.get("memory")
    if mem:
        lines.append(f"  GPU used: {mem['before']['device_used_gb']:.2f} GB before, "
                     f"{mem['after_first']['device_used_gb']:.2f} GB after the first update, "
                     f"{mem['after']['device_used_gb']:.2f} GB after the last ({mem['device_growth_pct']:+.2f}%)")
    lines.append(f"  engine holds the trainer's weights: {r['weights_match_trainer']}")
    return "\n".join(lines)
