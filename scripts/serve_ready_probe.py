"""How long `tandem serve` takes to be ready, and where the time goes (issue 25's start-up row).

Starts `python -m tandem.main serve` on a model folder (a preset's random-weight folder made with
`tandem tiny-model`, weights `--load-format dummy`), polls /health until it answers 200, and prints
the wall time from the command to ready beside the server's start-up line (its phases: before
engine = imports and argument checks, weights, kv_pool, tokenizer, runner = CUDA graphs, warm-up
and kernel compiles). Run it first on a fresh machine for the cold figure, then again for a warm
one. --evict drops the Python packages' files from the page cache before each run (a cold start on a
machine that is not fresh; scripts/page_cache_probe.py). Usage:
python scripts/serve_ready_probe.py --preset qwen3-8b [--runs 2] [--evict] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def time_to_ready(model_dir: str, port: int, extra: list[str], limit_s: float) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "tandem.main", "serve", "--model-path", model_dir, "--load-format", "dummy",
           "--skip-tokenizer-init", "--port", str(port), *extra]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    wall_start = time.time()
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while time.perf_counter() - start < limit_s:
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}) before it was ready:\n"
                                 + Path(log.name).read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        ready = time.perf_counter() - start
                        lines = Path(log.name).read_text().splitlines()
                        line = next((line for line in lines if " ready: " in line), "(no start-up line)")
                        return ready, f"{line}\n  {log_timeline(lines, wall_start)}"
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"not ready after {limit_s:.0f} s")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})( core)?\] (.*)")


def log_timeline(lines: list[str], wall_start: float) -> str:
    """Each stamped log line's second since the command (where the time outside the core's
    start-up goes: before its spawn, after its ready line)."""
    marks = []
    for line in lines:
        found = STAMP.match(line)
        if found:
            stamp = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S")) + int(found[2]) / 1e3
            marks.append(f"+{stamp - wall_start:.1f}s{' core' if found[3] else ''}: {found[4][:60]}")
    return "timeline: " + " | ".join(marks) if marks else "timeline: (no stamped lines)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--port", type=int, default=30002)
    parser.add_argument("--limit-s", type=float, default=240.0)
    parser.add_argument("--evict", action="store_true", help="page cache emptied of the packages before each run")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    model_dir = tempfile.mkdtemp(prefix=f"ready-{args.preset}-")
    subprocess.run([sys.executable, "-m", "tandem.main", "tiny-model", "--out", model_dir, "--preset", args.preset],
                   check=True, stdout=subprocess.DEVNULL)
    for run in range(args.runs):
        if args.evict:
            from page_cache_probe import evict_start_files

            print(f"evicted {evict_start_files()} files from the page cache", flush=True)
        ready, line = time_to_ready(model_dir, args.port, extra, args.limit_s)
        print(f"run {run + 1} ({'cold' if run == 0 or args.evict else 'warm'}): ready in {ready:.1f} s | {line}", flush=True)


if __name__ == "__main__":
    main()
