"""The LoRA acceptance figures (issue 26) from `device_suite.sh lora8`'s files: throughput with 1 and
8 adapters against the base model's (>= 0.85x, >= 0.75x), and the adapter push by CUDA IPC (<= 20 ms).
Usage: python3 scripts/summarize_lora.py OUT/lora8-0.json OUT/lora8-1.json OUT/lora8-8.json OUT/lora8-push.json
"""

import json
import sys

BOUNDS = {1: 0.85, 8: 0.75}  # adapters -> least throughput ratio to the base model
PUSH_BOUND_MS = 20.0


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"{path}: unreadable ({exc})")
        return None


def main(paths: list[str]) -> None:
    benches, push = {}, None
    for path in paths:
        r = _load(path)
        if r is None:
            continue
        if "pushes_s" in r:
            push = r
        else:
            benches[r["lora"]["adapters"]] = r["tandem"]["median"]["output_tok_s"]
    base = benches.get(0)
    for n, tok_s in sorted(benches.items()):
        line = f"{n} adapter(s): {tok_s:10,.1f} output tok/s"
        if n and base:
            bound = BOUNDS.get(n)
            line += f"  {tok_s / base:.3f}x base" + (f" (need >= {bound}: {'ok' if tok_s / base >= bound else 'SHORT'})"
                                                     if bound else "")
        print(line)
    if push:
        ms = push["median_s"]["push"] * 1e3
        mem = push.get("memory") or {}
        print(f"adapter push ({push['transport']}, rank {push['lora_rank']}, {push['total_bytes'] / 2**20:.1f} MiB): "
              f"median {ms:.2f} ms (need <= {PUSH_BOUND_MS:.0f}: {'ok' if ms <= PUSH_BOUND_MS else 'OVER'}); "
              f"phases " + " ".join(f"{k} {v * 1e3:.2f}" for k, v in push["median_s"].items())
              + f"; memory growth {mem.get('device_growth_pct', float('nan')):+.2f}%; outputs follow the push: "
              f"{push['adapter_changes_output'] and push['later_push_changes_output']}, engine = trainer: "
              f"{push['engine_adapter_matches_trainer']}")


if __name__ == "__main__":
    main(sys.argv[1:])
