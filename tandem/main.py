"""The `tandem` command: argument parsing and dispatch to the subcommands' handlers.

Handlers are imported only when their subcommand runs, so `tandem tiny-model` never pays for
(or depends on) the engine, and the HTTP stack loads only for `serve`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Optional, Sequence

from tandem.server_args import add_server_args

# subcommand -> (module, function); each function takes the parsed Namespace, returns an exit code
HANDLERS = {
    "tiny-model": ("engine.testing.tiny_model", "run"),
    "generate": ("tandem.generate", "run_generate"),
    "demo": ("tandem.generate", "run_demo"),
    "serve": ("tandem.serve", "run_serve"),
    "bench": ("tandem.bench.cli", "run_bench"),
    "bench-sync": ("tandem.bench_sync", "run_bench_sync"),
    "determinism": ("tandem.determinism.cli", "run_determinism"),
    "replay": ("tandem.determinism.cli", "run_replay"),
    "train": ("tandem.train", "run_train"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: an LLM serving engine "
                                     "for RL rollouts")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_tiny_model(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_bench_sync(sub)
    _add_determinism(sub)
    _add_replay(sub)
    _add_train(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # imports torch: a Ctrl-C often lands here
        handler = _handler(args.command)
    except KeyboardInterrupt:
        _interrupted("tandem")
    try:
        return int(handler(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("TANDEM_DEBUG"):
            raise
        sys.exit(f"tandem {args.command}: {user_message(exc)}")
    except KeyboardInterrupt:
        _interrupted(f"tandem {args.command}")


def _interrupted(who: str) -> None:
    """Ctrl-C: one line and the shell's 130, not a traceback (TANDEM_DEBUG=1 shows it)."""
    if os.environ.get("TANDEM_DEBUG"):
        raise
    print(f"{who}: interrupted", file=sys.stderr)
    sys.exit(130)


# Bad input (a flag's value, a path, a recipe field) raises these with a message that says what to
# change: the command prints that one line and exits 1, not a traceback (TANDEM_DEBUG=1 shows it).
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def user_message(exc: BaseException) -> str:
    """The error's own message; a Ray task's error is reported by its cause (not the remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and type(exc).__name__.startswith("RayTaskError"):
        exc = cause
    return str(exc).strip() or type(exc).__name__


def _handler(command: str) -> Callable[[argparse.Namespace], Optional[int]]:
    module_name, func_name = HANDLERS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # a real missing dependency inside the handler's module
            raise
        sys.exit(f"tandem {command}: not available in this build ({module_name} is missing)")
    return getattr(module, func_name)


def _add_tiny_model(sub: argparse._SubParsersAction) -> None:
    from engine.testing import tiny_model

    p = sub.add_parser("tiny-model", help="write a small HF-format Qwen3 checkpoint",
                       description="Write an HF-format Qwen3 checkpoint built locally.")
    tiny_model.add_arguments(p)


def _add_sampling(p: argparse.ArgumentParser, prompt_required: bool, max_new_tokens: int) -> None:
    p.add_argument("--prompt", action="append", required=prompt_required, default=None,
                   help="prompt text (repeat the flag for several prompts)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed: the same tokens whatever the batch")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a few prompts, in-process",
                       description="Load a checkpoint and generate for the given prompts.")
    _add_sampling(p, prompt_required=True, max_new_tokens=64)
    add_server_args(p, require_model_path=True)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the tiny model and generate from it",
                       description="Build (or reuse) the tiny model and generate from it, "
                       "printing text, tokens/s and cache hits. Nothing is downloaded.")
    _add_sampling(p, prompt_required=False, max_new_tokens=32)
    add_server_args(p, require_model_path=False)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the HTTP server (SGLang-compatible routes)",
                       description="Serve a checkpoint over HTTP.")
    add_server_args(p, require_model_path=True)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from tandem.bench.cli import add_arguments

    p = sub.add_parser("bench", help="offline benchmark: throughput, latency, vs HF and the roofline",
                       description="Run a synthetic workload through the engine in-process and "
                       "report throughput, TTFT / ITL, cache hits and memory; optionally HF "
                       "generate on the same weights and the device's roofline.")
    add_arguments(p)


def _add_bench_sync(sub: argparse._SubParsersAction) -> None:
    from tandem.bench_sync import add_arguments

    p = sub.add_parser("bench-sync", help="weight update time by phase (pause/transfer/load/flush/resume)",
                       description="Push a model's weights from a trainer to an engine N times over a "
                       "transport (inprocess, cuda-ipc, disk); report median phase times and GPU memory.")
    add_arguments(p)


def _add_determinism(sub: argparse._SubParsersAction) -> None:
    from tandem.determinism.cli import add_determinism_arguments

    p = sub.add_parser("determinism", help="check determinism: unique outputs, logprob differences",
                       description="Run SGLang's determinism modes (single, mixed, prefix, radix, "
                       "p_vs_d) against a server or an in-process engine; exit 1 if any fails.")
    add_determinism_arguments(p)


def _add_replay(sub: argparse._SubParsersAction) -> None:
    from tandem.determinism.cli import add_replay_arguments

    p = sub.add_parser("replay", help="re-run recorded requests (--record-path) and compare bitwise",
                       description="Re-run every request of a --record-path file with its prompt, "
                       "sampling params and seed; report any token or logprob that differs.")
    add_replay_arguments(p)


def _add_train(sub: argparse._SubParsersAction) -> None:
    from tandem.train import add_arguments

    p = sub.add_parser("train", help="RL: run a GRPO recipe (the embedded default when none is named)",
                       description="Run an RL recipe: rollouts on engines, rewards, GRPO update, weight push "
                       "every step. Alone, it runs the embedded default (tiny model, addition, CPU). Every "
                       "recipe field is a flag.")
    add_arguments(p)


if __name__ == "__main__":
    sys.exit(main())
