"""What a /generate request costs the `tandem serve` process itself (HTTP, parsing, building,
the pipe to the core, the reply), apart from the model: issue 25's HTTP rows lose to in-process
by what this process spends per request while the requests of a round arrive together.

Starts `tandem serve` on the tiny model (CPU, core in its own process), sends rounds of
`--concurrency` simultaneous /generate requests (512 random prompt ids, `--max-new-tokens`,
aiohttp), and prints the serve process's CPU time per request (/proc: user + system) and each
request's time outside the engine core (client latency less the core's e2e_latency), median and
max: a full garbage collection of the process shows up in the max. Linux only.
Usage: python scripts/serve_cpu_probe.py [--runs 3] [--rounds 8] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

PORT = 30077


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(session, url: str, ids: list[int], max_new_tokens: int) -> tuple[float, float]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    async with session.post(url + "/generate", json=body) as resp:
        out = await resp.json()
    return time.perf_counter() - start, out["meta_info"]["e2e_latency"]


async def probe(url: str, pid: int, rounds: int, concurrency: int, max_new_tokens: int) -> str:
    import aiohttp

    rng = random.Random(0)
    prompt = lambda: [rng.randrange(1000) for _ in range(512)]  # noqa: E731
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await one_request(session, url, prompt(), max_new_tokens)  # warm-up
        cpu0 = cpu_seconds(pid)
        results = []
        for _ in range(rounds):
            results += await asyncio.gather(*[one_request(session, url, prompt(), max_new_tokens)
                                              for _ in range(concurrency)])
        cpu1 = cpu_seconds(pid)
    n = len(results)
    outside = sorted(client - core for client, core in results)
    return (f"{n} requests: serve process CPU {1000 * (cpu1 - cpu0) / n:.2f} ms/request; outside the core "
            f"median {1000 * outside[n // 2]:.1f} ms, max {1000 * outside[-1]:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more `tandem serve` flags, after --")
    args = parser.parse_args()
    model_dir = tempfile.mkdtemp(prefix="serve-cpu-probe-")
    subprocess.run([sys.executable, "-m", "tandem.main", "tiny-model", "--out", model_dir, "--preset", "tiny"],
                   check=True, stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "tandem.main", "serve", "--model-path", model_dir, "--device", "cpu",
           "--dtype", "float32", "--skip-tokenizer-init", "--core-process", "--port", str(PORT), *args.extra]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        _wait_ready(url, server)
        for _ in range(args.runs):
            print(asyncio.run(probe(url, server.pid, args.rounds, args.concurrency, args.max_new_tokens)), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return 0


def _wait_ready(url: str, server: subprocess.Popen, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tandem serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"tandem serve was not ready in {limit_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
