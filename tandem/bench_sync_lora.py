"""`tandem bench-sync --lora-rank R`: how long pushing a LoRA adapter takes, and what it costs in memory.

LoRA RL's weight sync (trainer_bridge/adapter_sync.py, as Miles and slime drive SGLang): the
trainer's adapter replaces the served one under the same name: /unload_lora_adapter, then
/load_lora_adapter_from_tensors with its PEFT config and serialized_tensors (by reference: CUDA
IPC handles from a trainer in another process, opened through the weight payloads' allowlist
unpickler; shared memory on the CPU). No pause and no cache flush: a new load gets a fresh adapter
id, so cached prefixes of the old adapter never serve the new one. A push's phases: transfer (the
trainer serializes its bucket: handles, no copy), unload, load (the core opens the handles and
builds the adapter); push is their sum, the time a trainer waits. Reported: medians over
--num-updates pushes (each a new adapter in the same buffer), GPU memory before the first and
after the last push, and whether outputs follow: the adapter changes the base model's greedy
tokens, a new push changes them again, and the engine's tokens equal those of the trainer's last
adapter loaded from disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

ADAPTER = "bench-lora"
PHASES = ("transfer", "unload", "load", "push")
PROMPT_LEN, CHECK_TOKENS = 16, 8


def run_lora_push(args: argparse.Namespace) -> dict[str, Any]:
    from engine import Engine
    from tandem.bench_sync import start_trainer
    from tandem.lora_sync_trainer import LoRATrainer
    from tandem.preset_model import engine_kwargs_from_args

    if args.transport not in ("inprocess", "cuda-ipc"):
        raise SystemExit("tandem bench-sync --lora-rank: adapters are pushed by reference (--transport cuda-ipc) "
                         "or in memory (--transport inprocess)")
    kwargs, label = engine_kwargs_from_args(args, "bench-sync")
    if kwargs.get("max_lora_rank") is not None and kwargs["max_lora_rank"] < args.lora_rank:
        raise SystemExit(f"tandem bench-sync: --lora-rank {args.lora_rank} exceeds --max-lora-rank {kwargs['max_lora_rank']}")
    kwargs.update(enable_lora=True, max_lora_rank=kwargs.get("max_lora_rank") or args.lora_rank)
    engine = Engine(**kwargs)
    trainer = None
    try:
        trainer = start_trainer(args, engine, LoRATrainer, rank=args.lora_rank,
                                target_modules=tuple(args.lora_target_modules or ()))
        report = measure_pushes(engine, trainer, args.transport, args.num_updates, args.lora_load_format)
    finally:
        if trainer is not None:
            trainer.stop()
        engine.shutdown()
    report.update(model=label, transport=args.transport, trainer=getattr(trainer, "kind", None),
                  load_format=args.lora_load_format, device=engine.info.device, dtype=engine.info.dtype,
                  **trainer.layout)
    return report


def measure_pushes(engine: Any, trainer: Any, transport: str, num_pushes: int, load_format: str) -> dict[str, Any]:
    from tandem.bench_sync import gpu_memory, memory_report

    config = trainer.call("config_dict")
    prompt = _check_prompt(engine)
    outputs = {"base": _greedy(engine, prompt, None)}
    memory = {"before": gpu_memory(engine)}
    pushes = []
    for i in range(num_pushes):
        trainer.call("step", i + 1)  # the trainer's step: a new adapter, untimed
        pushes.append(_push(engine, trainer, transport, load_format, config, replace=i > 0))
        trainer.call("ipc_collect")
        if i == 0:
            memory["after_first"] = gpu_memory(engine)
            outputs["first"] = _greedy(engine, prompt, ADAPTER)
    memory["after"] = gpu_memory(engine)
    outputs["last"] = _greedy(engine, prompt, ADAPTER)
    medians = {p: statistics.median(u[p] for u in pushes) for p in PHASES}
    return {"num_updates": num_pushes, "median_s": medians, "pushes_s": [u["push"] for u in pushes],
            "memory": memory_report(memory), **_output_checks(engine, trainer, prompt, outputs, num_pushes)}


def _push(engine: Any, trainer: Any, transport: str, load_format: str, config: dict, replace: bool) -> dict:
    from tandem.bench_sync import synchronizer

    sync = synchronizer(engine)
    start = time.perf_counter()
    if transport == "inprocess":
        source = {"tensors": trainer.call("tensors", load_format)}
    else:
        source = {"serialized_tensors": trainer.call("payload", load_format)}
    sent = time.perf_counter()
    if replace:
        _check(engine.unload_lora_adapter(ADAPTER), "unload")
    unloaded = time.perf_counter()
    _check(engine.load_lora_adapter_from_tensors(ADAPTER, config_dict=config, load_format=load_format, **source), "load")
    sync()
    end = time.perf_counter()
    return {"transfer": sent - start, "unload": unloaded - sent, "load": end - unloaded, "push": end - start}


def _output_checks(engine: Any, trainer: Any, prompt: list[int], outputs: dict, num_pushes: int) -> dict:
    """The adapter's tokens differ from the base's; a later push's from the first's; and equal those
    of the trainer's current adapter loaded from disk under another name."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-sync-lora-") as scratch:
        path = trainer.call("save", scratch)
        _check(engine.load_lora_adapter("bench-lora-disk", path), "load from disk")
        from_disk = _greedy(engine, prompt, "bench-lora-disk")
        _check(engine.unload_lora_adapter("bench-lora-disk"), "unload")
    return {"outputs": {**outputs, "disk_copy": from_disk},
            "adapter_changes_output": outputs["last"] != outputs["base"],
            "later_push_changes_output": None if num_pushes < 2 else outputs["last"] != outputs["first"],
            "engine_adapter_matches_trainer": outputs["last"] == from_disk}


def _check_prompt(engine: Any) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(engine.info.vocab_size) for _ in range(PROMPT_LEN)]


def _greedy(engine: Any, prompt: list[int], lora_path: Any) -> list[int]:
    out = engine.generate(input_ids=prompt, lora_path=lora_path,
                          sampling_params={"max_new_tokens": CHECK_TOKENS, "temperature": 0.0, "ignore_eos": True})
    return out["output_ids"]


def _check(reply: dict, verb: str) -> None:
    if not reply.get("success"):
        raise RuntimeError(f"LoRA {verb} refused: {reply.get('error_message')}")


def format_lora_report(r: dict[str, Any]) -> str:
    lines = [f"tandem bench-sync: LoRA push, {r['model']} ({r['device']}, {r['dtype']}), transport {r['transport']}"
             + (f" (trainer: {r['trainer']})" if r.get("trainer") else ""),
             f"  rank {r['lora_rank']} on {', '.join(r['lora_target_modules'])}: {r['num_tensors']} tensors, "
             f"{r['total_bytes'] / 2**20:.1f} MiB ({r['load_format']}); {r['num_updates']} pushes",
             "  median (ms): " + "  ".join(f"{p} {r['median_s'][p] * 1e3:.2f}" for p in PHASES)]
    mem = r.get("memory")
    if mem:
        lines.append(f"  GPU used: {mem['before']['device_used_gb']:.2f} GB before, "
                     f"{mem['after_first']['device_used_gb']:.2f} GB after the first push, "
                     f"{mem['after']['device_used_gb']:.2f} GB after the last ({mem['device_growth_pct']:+.2f}%)")
    lines.append(f"  adapter changes the output: {r['adapter_changes_output']}; a later push changes it: "
                 f"{r['later_push_changes_output']}; engine's adapter equals the trainer's: "
                 f"{r['engine_adapter_matches_trainer']}")
    return "\n".join(lines)
