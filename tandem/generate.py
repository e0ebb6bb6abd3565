"""`tandem generate` and `tandem demo`: generate from the command line and report speed."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tandem.server_args import add_server_args, server_args_from_namespace

DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The capital of France is",
]
DEMO_SHARED_PREFIX = "You are a helpful assistant. Answer briefly and clearly. " * 8


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    _add_sampling(p, prompt_required=True, max_new_tokens=64)
    add_server_args(p, require_model_path=True)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    _add_sampling(p, prompt_required=False, max_new_tokens=32)
    add_server_args(p, require_model_path=False)


def _add_sampling(p: argparse.ArgumentParser, prompt_required: bool, max_new_tokens: int) -> None:
    p.add_argument("--prompt", action="append", required=prompt_required, default=None,
                   help="prompt text (repeat the flag for several prompts)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request seed: the same tokens whatever the batch")


def run_generate(args: argparse.Namespace) -> int:
    from engine import Engine

    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.sampling_seed is not None:
        params["sampling_seed"] = args.sampling_seed
    with Engine(**server_args_from_namespace(args)) as eng:
        _report(eng, args.prompt, params)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.testing.tiny_model import tiny_model_path

    kwargs = server_args_from_namespace(args)
    if "model_path" not in kwargs:
        kwargs["model_path"] = str(tiny_model_path())
        print(f"tiny model: {kwargs['model_path']}")
    with Engine(**kwargs) as eng:
        params = {"max_new_tokens": 32, "temperature": 0.0}
        print("\n== cold: four prompts in one batch ==")
        _report(eng, DEMO_PROMPTS, params)
        print("\n== warm: prompts sharing a long system prefix (radix cache hits) ==")
        _report(eng, [DEMO_SHARED_PREFIX + p for p in DEMO_PROMPTS[:2]], params)
        _report(eng, [DEMO_SHARED_PREFIX + p for p in DEMO_PROMPTS[2:]], params)
        eng.check_integrity()
    return 0


def _report(eng: Any, prompts: list[str], params: dict) -> None:
    start = time.perf_counter()
    outs = eng.generate(prompt=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    n_prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    n_cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    for prompt, out in zip(prompts, outs):
        text = out["text"].encode("unicode_escape").decode("ascii")  # random weights emit control bytes
        print(f"- {prompt[-40:]!r} -> {text[:80]} ({out['meta_info']['finish_reason']['type']})")
    print(f"{len(outs)} requests, {n_out} output tokens in {elapsed:.2f}s = {n_out / elapsed:.1f} tok/s; "
          f"cache hits {n_cached}/{n_prompt} prompt tokens ({n_cached / max(n_prompt, 1):.0%})")
