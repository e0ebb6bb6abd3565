"""One line per `tandem bench --json` file: the numbers a comparison needs (det vs normal, ...)."""

import json
import sys


def main(paths: list[str]) -> None:
    print(f"{'file':40} {'reqs':>5} {'det':>5} {'attn':>8} {'out tok/s':>10} {'wall s':>7} {'start s':>7}")
    for path in sorted(paths):
        with open(path) as f:
            r = json.load(f)
        med = r["tandem"]["median"]
        det = r["server_args"].get("enable_deterministic_inference")
        print(f"{path.rsplit('/', 1)[-1]:40} {r['workload']['num_requests']:5d} {str(det):>5} "
              f"{r['attention_backend']:>8} {med['output_tok_s']:10.1f} {med['wall_s']:7.2f} "
              f"{r['engine_startup_s']:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
