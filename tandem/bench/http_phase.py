"""The HTTP phases of `tandem bench`: `--url` measures a running server alone; `--serve` starts
`tandem serve` after the in-process runs and measures it the same way, for the ratio
HTTP / in-process (the price of serving over HTTP) and a check that greedy outputs agree.
"""

from __future__ import annotations

import logging
import shlex
from typing import TYPE_CHECKING, Any

from tandem.bench.http_run import HttpBench
from tandem.bench.stats import median_of_runs, ratio
from tandem.bench.workload import Workload

if TYPE_CHECKING:
    from tandem.bench.cli import Bench

logger = logging.getLogger("tandem")


def run_against_url(bench: "Bench") -> dict[str, Any]:
    """A running server only: the workload is sized from its /get_server_info."""
    import torch

    args = bench.args
    client = _client(bench, args.url)
    info = client.server_info()
    if args.input_len + args.output_len > info["context_len"]:
        raise SystemExit(f"tandem bench: --input-len + --output-len exceeds the server's context length "
                         f"{info['context_len']}")
    workload = bench._workload(info["vocab_size"], args.seed)
    warmup = bench._workload(info["vocab_size"], args.seed + 1)
    result = bench._header(torch.device("cpu"), torch.__version__)
    result.update(model=info.get("model_path", args.url), device=f"server {args.url} ({info.get('device')})",
                  workload=workload.describe(), dtype=info.get("dtype"),
                  attention_backend=info.get("attention_backend"), engine_startup_s=None,
                  server_args={k: v for k, v in info.items() if k != "internal_states"})
    _measure(bench, result, client, workload, warmup)
    return result


def run_served(bench: "Bench", result: dict, workload: Workload, warmup: Workload) -> None:
    """After the in-process runs (their engine is shut down): the same settings behind HTTP."""
    from tandem.bench.served_engine import ServedEngine

    with ServedEngine(bench.engine_kwargs, shlex.split(bench.args.serve_args)) as served:
        result["serve_command"] = "tandem " + shlex.join(served.argv[3:])  # argv: python -m tandem.main ...
        result["serve_startup_s"] = served.startup_s
        _measure(bench, result, _client(bench, served.url), workload, warmup)


def _measure(bench: "Bench", result: dict, client: HttpBench, workload: Workload, warmup: Workload) -> None:
    from tandem.bench.hf_baseline import agreement

    args = bench.args
    outcomes = client.run_all(warmup, workload, args.warmup_runs, args.runs, args.stream_mode)
    for i, outcome in enumerate(outcomes):
        logger.info("HTTP run %d/%d: %.1f output tok/s", i + 1, len(outcomes), outcome.metrics["output_tok_s"])
    runs = [o.metrics for o in outcomes]
    result["http"] = {"median": median_of_runs(runs), "runs": runs, "url": client.url}
    if "tandem" in result:
        result["ratios"]["http_over_in_process"] = ratio(result["http"]["median"]["output_tok_s"],
                                                         result["tandem"]["median"]["output_tok_s"])
        result["ratios"]["http_agreement"] = agreement(bench._tandem_output_ids, outcomes[-1].output_ids)


def _client(bench: "Bench", url: str) -> HttpBench:
    kwargs = bench.engine_kwargs
    return HttpBench(url, getattr(bench.args, "api_key", None) or kwargs.get("api_key"),
                     getattr(bench.args, "admin_api_key", None) or kwargs.get("admin_api_key"))
