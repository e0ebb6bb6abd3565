"""`tandem determinism` and `tandem replay`: flags, and running them over a client.

Both run against a server (--url) or an in-process Engine (--model-path or --preset plus any
ServerArgs flag). In-process, deterministic inference is on unless
--no-enable-deterministic-inference is given.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from tandem.determinism.harness import DEFAULT_PREFIX_LENS, MODES


def add_determinism_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("harness")
    g.add_argument("--mode", choices=MODES + ("all",), default="all",
                   help="which check to run (see `engine/determinism/harness.py`); all: every mode")
    g.add_argument("--trials", type=int, default=50, help="trials per mode")
    g.add_argument("--max-new-tokens", type=int, default=32, help="output tokens per measured request")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; > 0: sampled, every measured request with --sampling-seed")
    g.add_argument("--sampling-seed", type=int, default=42)
    g.add_argument("--prompt-len", type=int, default=300, help="tokens of the target prompt")
    g.add_argument("--prefix-lens", type=_int_list, default=DEFAULT_PREFIX_LENS, metavar="N,N,...",
                   help="prefix mode: prompt lengths (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts and batches")
    g.add_argument("--tolerance", type=float, default=0.0,
                   help="largest |Δ logprob| that passes (0: bitwise)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    _add_target(p)


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.jsonl", help="a file written with --record-path")
    p.add_argument("--batch-size", type=int, default=64, help="records sent together")
    p.add_argument("--max-report", type=int, default=20, help="differences and bad records printed")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report here")
    _add_target(p)


def _add_target(p: argparse.ArgumentParser) -> None:
    from tandem.server_args import add_server_args
    from tandem.preset_model import add_preset_argument

    t = p.add_argument_group("target", "a running server (--url), or an in-process engine")
    t.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:30000")
    add_preset_argument(t)
    t.add_argument("--enable-deterministic-inference", action=argparse.BooleanOptionalAction,
                   default=True, help="in-process engine: deterministic inference (default: on)")
    add_server_args(p, require_model_path=False)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def make_client(args: argparse.Namespace, command: str) -> tuple[Any, str]:
    """-> (client, a label for what it talks to)."""
    if args.url:
        if args.preset or args.model_path:
            raise SystemExit(f"tandem {command}: give --url or --model-path/--preset, not both")
        from tandem.determinism.client import HttpClient

        return HttpClient(args.url, api_key=args.api_key), args.url
    from tandem.determinism.client import EngineClient
    from tandem.preset_model import engine_kwargs_from_args

    kwargs, label = engine_kwargs_from_args(args, command)
    return EngineClient(**kwargs), label


def run_determinism(args: argparse.Namespace) -> int:
    from tandem.determinism.harness import Harness, HarnessConfig, modes_of
    from tandem.determinism.report import format_table, progress_line

    try:
        config = HarnessConfig(args.trials, args.max_new_tokens, args.temperature, args.sampling_seed,
                               args.prompt_len, args.prefix_lens, args.seed, args.tolerance)
    except ValueError as exc:
        raise SystemExit(f"tandem determinism: {exc}") from exc
    client, label = make_client(args, "determinism")
    results = []
    try:
        harness = Harness(client, config)
        for mode in modes_of(args.mode):  # JSON after every mode: a cut-short run keeps its results
            results.append(harness.run_mode(mode))
            print(progress_line(results[-1]), flush=True)
            _save(args, label, harness.info, config, results, partial=True)
    finally:
        client.close()
    header = (f"determinism: {label}, deterministic={harness.info.get('deterministic', '?')}, "
              f"{config.trials} trials, {config.max_new_tokens} new tokens, T={config.temperature}")
    print(format_table(results, header))
    if _save(args, label, harness.info, config, results, partial=False):
        print(f"wrote {args.json}")
    return 0 if all(r.passed for r in results) else 1


def _save(args: argparse.Namespace, label: str, info: dict, config: Any, results: list, partial: bool) -> bool:
    if not args.json:
        return False
    import dataclasses

    from tandem.determinism.report import to_json, write_json

    extra = {"command": shlex.join(sys.argv), "model": label, "server": info,
             "config": dataclasses.asdict(config), "partial": partial}
    write_json(args.json, to_json(results, extra))
    return True


def run_replay(args: argparse.Namespace) -> int:
    import dataclasses

    from tandem.determinism.replay import Replayer, format_summary
    from tandem.determinism.report import write_json

    try:
        handle = open(args.file, encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"tandem replay: cannot read {args.file}: {exc}") from exc
    client, label = make_client(args, "replay")
    try:
        with handle:
            summary = Replayer(client, args.batch_size).run(handle)
    finally:
        client.close()
    print(f"replay of {args.file} on {label}")
    print(format_summary(summary, args.max_report))
    if args.json:
        write_json(args.json, {"command": shlex.join(sys.argv), "file": args.file, "model": label,
                               "ok": summary.ok, **dataclasses.asdict(summary)})
        print(f"wrote {args.json}")
    return 0 if summary.ok else 1
