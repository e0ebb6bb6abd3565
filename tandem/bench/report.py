"""The benchmark's outputs: a plain-text table on stdout and, with --json, every number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

# (label, key in the tandem/HF medians, format)
ROWS: list[tuple[str, str, str]] = [
    ("output tok/s", "output_tok_s", "{:,.1f}"),
    ("input tok/s", "input_tok_s", "{:,.1f}"),
    ("wall time (s)", "wall_s", "{:.3f}"),
    ("TTFT median (ms)", "ttft_median_ms", "{:.2f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.2f}"),
    ("ITL median (ms)", "itl_median_ms", "{:.3f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.3f}"),
    ("outside core med ms", "outside_core_median_ms", "{:.1f}"),  # HTTP runs: tandem/bench/http_run.py
    ("outside core max ms", "outside_core_max_ms", "{:.1f}"),
    ("cache hit rate", "cache_hit_rate", "{:.3f}"),
    ("retractions", "retractions", "{:.0f}"),
    ("peak memory (GiB)", "peak_memory_gb", "{:.2f}"),
]


OPTIONAL_KEYS = {"outside_core_median_ms", "outside_core_max_ms"}  # rows left out where no column has them


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


# (result key, column heading): the in-process engine, the same over HTTP, HF generate
COLUMNS: list[tuple[str, str]] = [("tandem", "tandem"), ("http", "tandem HTTP"), ("hf", "HF generate")]


def format_table(result: dict[str, Any]) -> str:
    columns = [(title, (result.get(key) or {}).get("median") or {}) for key, title in COLUMNS
               if key in result]
    runs = (result.get("tandem") or result.get("http"))["runs"]
    w = result["workload"]
    startup = result.get("engine_startup_s")
    lines = [
        f"tandem bench | {result['model']} | {w['kind']}: {w['num_requests']} requests "
        f"({w['num_prompts']} prompts x n={w['n']}), mean {w['mean_input_len']:.0f} in / "
        f"{w['mean_output_len']:.0f} out | median of {len(runs)} run(s)",
        f"device {result['device']} | torch {result['torch_version']} | dtype {result['dtype']} | "
        f"attention {result['attention_backend']} | engine start-up {_fmt(startup, '{:.1f}')} s",
        "",
        f"{'metric':<20}" + "".join(f" {title:>14}" for title, _ in columns),
    ]
    for label, key, pattern in ROWS:
        if key in OPTIONAL_KEYS and all(median.get(key) is None for _, median in columns):
            continue
        cells = "".join(f" {_fmt(median.get(key), pattern) if median else '':>14}" for _, median in columns)
        lines.append(f"{label:<20}{cells}")
    lines += _summary_lines(result)
    return "\n".join(lines)


def _summary_lines(result: dict[str, Any]) -> list[str]:
    out = [""]
    ratios = result.get("ratios", {})
    lora = result.get("lora") or {}
    if lora.get("adapters"):
        out.append(f"LoRA: {lora['adapters']} adapter(s) of rank {lora['rank']} on {', '.join(lora['target_modules'])}; "
                   f"requests {lora['assignment']} over them (max {lora['max_loras_per_batch']} per batch)")
    if result.get("serve_command"):
        out.append(f"served: {result['serve_command']} (start-up {result['serve_startup_s']:.1f} s)")
    if ratios.get("http_over_in_process") is not None:
        agree = ratios.get("http_agreement")
        out.append(f"tandem HTTP / in-process output tok/s: {ratios['http_over_in_process']:.2f}x"
                   + (f" (outputs identical for {agree:.0%} of requests)" if agree is not None else ""))
    if (result.get("hf") or {}).get("error"):
        out.append(f"HF baseline failed: {result['hf']['error']}")
    if ratios.get("tandem_over_hf") is not None:
        agree = ratios.get("hf_agreement")
        out.append(f"tandem / HF output tok/s: {ratios['tandem_over_hf']:.2f}x"
                   + (f" (greedy outputs identical for {agree:.0%} of requests)" if agree is not None else ""))
    roof: Optional[dict] = result.get("roofline")
    if roof:
        out.append(
            f"roofline: copy {roof['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s, matmul "
            f"{roof['matmul_flops_s'] / 1e12:.1f} TFLOP/s ({roof['matmul_dtype']} {roof['matmul_size']}^3); "
            f"floor = prefill {roof['prefill_floor_s']:.3f} s + decode {roof['decode_steps']} steps x "
            f"{roof['decode_step_floor_ms']:.3f} ms ({roof['decode_bound']} bound, batch {roof['decode_batch']})")
        out.append(f"roofline output tok/s: {roof['output_tok_s']:,.1f}; tandem reaches "
                   f"{ratios.get('tandem_over_roofline', 0):.1%} of it")
    return out


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    as_dict: Optional[Callable[[], Any]] = getattr(obj, "_asdict", None)
    return as_dict() if as_dict else str(obj)
