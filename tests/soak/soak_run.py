"""The soak (issues 14, 27): `tandem serve` on the tiny model (CPU) under N minutes of mixed load,
then the checks. Run it with scripts/soak.py (`python scripts/soak.py --minutes 30 --out
/tmp/soak`) or through tests/soak/test_soak.py (marked `soak`). docs/soak.md has the figures.

Load: client loops (streamed and not, /generate and chat, random sampling, clients leaving
mid-way, aborts by rid) and one controller (pauses in every mode, weight updates alternating two
checkpoints from disk or from tensors, flushes, aborts, malformed bodies); RSS and KV usage every
10 s (report.json, samples.csv). After it: no 5xx and no request without an answer (each has a
timeout), the engine idle at once, every KV slot free after a flush, greedy output equal to a
fresh engine on the final checkpoint, RSS bounded and, over >= 20 minutes, RSS and KV usage flat
(the last 10 minutes against minutes 5-10), SIGTERM exits promptly.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the soak_* modules, when run as a script

from soak_control import Controller  # noqa: E402
from soak_requests import Clients, generation_mix  # noqa: E402
from soak_server import ServeProcess, build_checkpoints  # noqa: E402
from soak_tally import REQUEST_TIMEOUT_S, Tally  # noqa: E402

GREEDY_PROMPT = [5, 17, 42, 99, 7, 300, 12, 8]
GREEDY_PARAMS = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
RSS_GROWTH_MB = 64.0  # allowed growth over the run, plus RSS_GROWTH_SHARE of the warm RSS
RSS_GROWTH_SHARE = 0.15
IDLE_WITHIN_S = 30.0
STOP_WITHIN_S = 10.0
SAMPLE_S = 10.0


async def client_loop(clients: Clients, tally: Tally, rng: random.Random, stop_at: float) -> None:
    mix = generation_mix()
    kinds, weights = [m[:1] + m[2:] for m in mix], [m[1] for m in mix]
    while time.monotonic() < stop_at:
        (kind, action), = rng.choices(kinds, weights)
        await tally.guarded(kind, action(clients, rng))


async def sample_usage(server: ServeProcess, http: httpx.AsyncClient, tally: Tally, samples: list,
                       stop_at: float) -> None:
    """Every SAMPLE_S: [seconds, server RSS MiB, KV slots used, KV usage share] (/v1/loads answers
    from the core's last report, never held up by a busy core); a progress line each minute."""
    next_line = 60.0
    while True:
        await asyncio.sleep(min(SAMPLE_S, max(stop_at - time.monotonic(), 0.1)))
        samples.append(await usage_sample(server, http, tally.started))
        seconds = samples[-1][0]
        if seconds >= next_line or time.monotonic() >= stop_at:
            next_line += 60.0
            print(f"[soak] {seconds / 60:5.1f} min  rss {samples[-1][1]:7.1f} MiB  kv {samples[-1][3]:.3f}"
                  f"  requests {sum(tally.counts.values())}  failures {sum(tally.failures().values())}", flush=True)
        if time.monotonic() >= stop_at:
            return


async def usage_sample(server: ServeProcess, http: httpx.AsyncClient, started: float) -> list:
    try:
        load = (await http.get("/v1/loads", timeout=10)).json()["loads"][0]
        kv = [load["num_used_tokens"], round(load["token_usage"], 4)]
    except (httpx.HTTPError, ValueError, KeyError):  # the sample is missing, the soak goes on
        kv = [None, None]
    return [round(time.monotonic() - started, 1), round(server.rss_mb(), 1), *kv]


def flatness(samples: list, minutes: float) -> dict[str, Any]:
    """Over a run of >= 20 minutes: the last 10 minutes against minutes 5-10. RSS: the last
    window's peak within 10% of the reference window's peak. KV usage (a share of the pool; the
    radix cache fills it and flushes empty it, so it swings between ~0 and 1 within minutes, and
    its means over windows differ by chance): the last window's floor (what stays held even right
    after a flush: where leaked slots show) at most 0.10 of the pool above the reference window's;
    the means are reported."""
    if minutes < 20:
        return {"checked": False, "why": "the run is shorter than 20 minutes"}
    ref = [s for s in samples if 300 <= s[0] < 600]
    last = [s for s in samples if s[0] >= minutes * 60 - 600]
    rss_ref, rss_last = max(s[1] for s in ref), max(s[1] for s in last)
    kv_ref, kv_last = [s[3] for s in ref if s[3] is not None], [s[3] for s in last if s[3] is not None]
    report = {"checked": True, "rss_peak_min5_10": rss_ref, "rss_peak_last10": rss_last,
              "kv_mean_min5_10": _mean(kv_ref), "kv_mean_last10": _mean(kv_last),
              "kv_floor_min5_10": min(kv_ref), "kv_floor_last10": min(kv_last)}
    report["rss_flat"] = rss_last <= rss_ref * 1.10
    report["kv_flat"] = report["kv_floor_last10"] <= report["kv_floor_min5_10"] + 0.10
    return report


def _mean(values: list) -> float:
    return round(sum(values) / max(len(values), 1), 4)


async def drive(server: ServeProcess, checkpoints: tuple[str, str], minutes: float, num_clients: int,
                seed: int, tally: Tally, rss: list) -> Controller:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S + 10, limits=limits) as http:
        clients = Clients(http, server.admin, finish_reasons=tally.finish_reasons)
        controller = Controller(clients, tally, checkpoints)
        stop_at = time.monotonic() + minutes * 60
        await asyncio.gather(
            *[client_loop(clients, tally, random.Random(seed * 1000 + i), stop_at) for i in range(num_clients)],
            controller.run(random.Random(seed), stop_at, time.monotonic),
            sample_usage(server, http, tally, rss, stop_at))
    return controller


def after_load(server: ServeProcess, controller: Controller) -> dict[str, Any]:
    """The server's state once the load stops: idle, KV all free after a flush, its greedy
    output, its weight version and counters."""
    http = httpx.Client(base_url=server.url, timeout=60)
    http.post("/continue_generation", headers=server.admin)
    start, loads = time.monotonic(), None
    while time.monotonic() - start < IDLE_WITHIN_S:
        loads = http.get("/v1/loads").json()["aggregate"]
        if loads["num_total_reqs"] == 0:
            break
        time.sleep(0.2)
    flush = http.post("/flush_cache", headers=server.admin).status_code
    load = http.get("/v1/loads").json()["loads"][0]
    greedy = http.post("/generate", json={"input_ids": GREEDY_PROMPT, "sampling_params": GREEDY_PARAMS}).json()
    metrics = dict(re.findall(r"^(tandem_\w+?)(?:_total)? ([0-9.e+-]+)$", http.get("/metrics").text, re.M))
    return {"idle_after_s": round(time.monotonic() - start, 2), "reqs_left": loads and loads["num_total_reqs"],
            "flush_status": flush, "kv_used_after_flush": load["num_used_tokens"],
            "kv_pool": load["max_total_num_tokens"], "health_generate": http.get("/health_generate").status_code,
            "weight_version": http.get("/get_weight_version").json()["weight_version"],
            "expected_weight_version": controller.version_name, "final_checkpoint": "ab"[controller.current],
            "greedy_server": greedy["output_ids"],
            "metrics": {k: float(v) for k, v in metrics.items()}}


def fresh_greedy(model_path: str) -> list[int]:
    from engine import Engine

    with Engine(model_path=model_path, dtype="float32", device="cpu") as eng:
        return eng.generate(input_ids=GREEDY_PROMPT, sampling_params=GREEDY_PARAMS)["output_ids"]


def failures(report: dict[str, Any]) -> list[str]:
    """Every check the soak makes, as the list of those that failed (empty: passed)."""
    out = [f"{k}: {n}" for k, n in report["failures"].items()]
    state, rss = report["after"], report["samples"]
    if state["reqs_left"]:
        out.append(f"{state['reqs_left']} requests still in the engine {IDLE_WITHIN_S:.0f} s after the load")
    if state["flush_status"] != 200 or state["kv_used_after_flush"] > 1:  # slot 0 is the padding slot
        out.append(f"KV not all free after a flush: {state['kv_used_after_flush']} of {state['kv_pool']} used "
                   f"(flush answered {state['flush_status']})")
    if state["health_generate"] != 200:
        out.append(f"/health_generate answered {state['health_generate']}")
    if state["expected_weight_version"] and state["weight_version"] != state["expected_weight_version"]:
        out.append(f"weight_version {state['weight_version']} != last update's {state['expected_weight_version']}")
    if state["greedy_server"] != report["greedy_fresh"]:
        out.append("greedy output differs from a fresh engine on the final checkpoint")
    warm_at = [s[1] for s in rss if s[0] >= 60]  # after a minute of load: allocator pools are warm
    warm = warm_at[0] if len(warm_at) > 1 else rss[0][1]
    if rss[-1][1] > warm * (1 + RSS_GROWTH_SHARE) + RSS_GROWTH_MB:
        out.append(f"RSS grew from {warm} to {rss[-1][1]} MiB")
    flat = report["flatness"]
    if flat["checked"] and not (flat["rss_flat"] and flat["kv_flat"]):
        out.append(f"not flat over the last 10 minutes: {flat}")
    # uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done: -15 is a clean exit
    if report["sigterm_exit"][0] not in (0, -signal.SIGTERM) or report["sigterm_exit"][1] > STOP_WITHIN_S:
        out.append(f"SIGTERM: exit {report['sigterm_exit']}")
    return out


def start_grammar_workers(server: ServeProcess) -> None:
    """One constrained request before the first sample: the grammar-compile worker processes
    (~280 MB each) start with the first grammar, and they belong to the warm server, not to growth."""
    body = {"text": "warm", "sampling_params": {"max_new_tokens": 2, "regex": "[ab]+"}}
    status = httpx.post(f"{server.url}/generate", json=body, timeout=REQUEST_TIMEOUT_S).status_code
    if status != 200:
        raise RuntimeError(f"the constrained warm-up request answered {status}")


def run_soak(minutes: float, out_dir: Path, num_clients: int = 24, seed: int = 0) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = build_checkpoints(out_dir / "checkpoints")
    server = ServeProcess(checkpoints[0], out_dir / "server.log")
    try:
        server.wait_ready()
        start_grammar_workers(server)
        tally, began = Tally(), time.monotonic()
        rss = [[0.0, round(server.rss_mb(), 1), None, None]]
        controller = asyncio.run(drive(server, checkpoints, minutes, num_clients, seed, tally, rss))
        load_s = time.monotonic() - began
        state = after_load(server, controller)
    finally:
        exit_code, stop_s = server.stop(STOP_WITHIN_S)
    report = {"minutes": minutes, "clients": num_clients, "seed": seed, "load_seconds": round(load_s, 1),
              "requests": sum(tally.counts.values()), "by_kind": tally.by_kind(), "statuses": tally.statuses(),
              "failures": tally.failures(),
              "finish_reasons": {f"{tag}: {reason}": n for (tag, reason), n in sorted(tally.finish_reasons.items())},
              "failure_notes": tally.notes, "samples": rss, "flatness": flatness(rss, minutes), "after": state,
              "greedy_fresh": fresh_greedy(checkpoints[controller.current]),
              "sigterm_exit": [exit_code, round(stop_s, 2)]}
    report["checks_failed"] = failures(report)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    write_samples(out_dir / "samples.csv", rss)
    return report


def write_samples(path: Path, samples: list) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seconds", "rss_mib", "kv_tokens_used", "kv_token_usage"])
        writer.writerows(samples)
