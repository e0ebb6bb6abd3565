"""The `tandem` command: argument parsing and dispatch to the subcommands' handlers.

Handlers are imported only when their subcommand runs, so `tandem tiny-model` never pays for
(or depends on) the engine, and the HTTP stack loads only for `serve`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    description: str
    adder: str  # "module:function" that adds the command's flags to its parser
    runner: str  # "module:function" that runs it on the parsed Namespace and returns an exit code


COMMANDS = {c.name: c for c in (
    Command("tiny-model", "write a small HF-format Qwen3 checkpoint",
            "Write an HF-format Qwen3 checkpoint built locally.",
            "engine.testing.tiny_model:add_arguments", "engine.testing.tiny_model:run"),
    Command("generate", "generate text for a few prompts, in-process",
            "Load a checkpoint and generate for the given prompts.",
            "tandem.generate:add_generate_arguments", "tandem.generate:run_generate"),
    Command("demo", "build the tiny model and generate from it",
            "Build (or reuse) the tiny model and generate from it, printing text, tokens/s and cache hits. "
            "Nothing is downloaded.",
            "tandem.generate:add_demo_arguments", "tandem.generate:run_demo"),
    Command("serve", "run the HTTP server (SGLang-compatible routes)", "Serve a checkpoint over HTTP.",
            "tandem.server_args:add_server_args", "tandem.serve:run_serve"),
    Command("bench", "offline benchmark: throughput, latency, vs HF and the roofline",
            "Run a synthetic workload through the engine in-process and report throughput, TTFT / ITL, cache "
            "hits and memory; optionally HF generate on the same weights and the device's roofline.",
            "tandem.bench.cli:add_arguments", "tandem.bench.cli:run_bench"),
    Command("bench-sync", "weight update time by phase (pause/transfer/load/flush/resume)",
            "Push a model's weights from a trainer to an engine N times over a transport (inprocess, "
            "cuda-ipc, disk); report median phase times and GPU memory.",
            "tandem.bench_sync:add_arguments", "tandem.bench_sync:run_bench_sync"),
    Command("determinism", "check determinism: unique outputs, logprob differences",
            "Run SGLang's determinism modes (single, mixed, prefix, radix, p_vs_d) against a server or an "
            "in-process engine; exit 1 if any fails.",
            "tandem.determinism.cli:add_determinism_arguments", "tandem.determinism.cli:run_determinism"),
    Command("replay", "re-run recorded requests (--record-path) and compare bitwise",
            "Re-run every request of a --record-path file with its prompt, sampling params and seed; report "
            "any token or logprob that differs.",
            "tandem.determinism.cli:add_replay_arguments", "tandem.determinism.cli:run_replay"),
    Command("train", "RL: run a GRPO recipe (the embedded default when none is named)",
            "Run an RL recipe: rollouts on engines, rewards, GRPO update, weight push every step. Alone, it "
            "runs the embedded default (tiny model, addition, CPU). Every recipe field is a flag.",
            "tandem.train:add_arguments", "tandem.train:run_train"),
)}


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """Each command's flags come from its adder; its runner's module is imported only when it runs.
    With `only`, every command is listed but only that one's flags are added: an adder imports its
    module (bench-sync's imports torch), and `tandem serve` must not wait seconds for torch on a
    fresh machine before it spawns its core process."""
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: an LLM serving engine "
                                     "for RL rollouts")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        if only is None or command.name == only:
            _resolve(command.adder)(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = argv[0] if argv and argv[0] in COMMANDS else None  # the top level has no flags but -h
    try:
        args = build_parser(only=named).parse_args(argv)  # may import torch: a Ctrl-C often lands here
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
    runner = COMMANDS[command].runner
    module_name = runner.partition(":")[0]
    try:
        return _resolve(runner)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # a real missing dependency inside the handler's module
            raise
        sys.exit(f"tandem {command}: not available in this build ({module_name} is missing)")


def _resolve(spec: str) -> Callable:
    """The function a "module:function" spec names, its module imported now."""
    module_name, _, func_name = spec.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


if __name__ == "__main__":
    sys.exit(main())
