"""Where return_routed_experts' cost goes: one engine started with --enable-return-routed-experts
(the forward writes routes either way), the same workload with the per-request flag off and on,
and the time the core spends reading and encoding the routes.

    python scripts/routes_cost_probe.py --preset qwen3-30b-a3b [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from engine import Engine
from engine.core.routed_experts import RouteReader
from engine.testing.tiny_model import tiny_model_path
from engine.core.setup import resolve_device
from tandem.bench.device import free_memory
from tandem.bench.workload import build_workload

spent = {"read_routes": 0.0, "encode": 0.0}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    RouteReader._to_host = timed("read_routes", RouteReader._to_host)
    RouteReader.read = timed("encode", RouteReader.read)  # gather, copy and encode together
    path = tiny_model_path(preset=args.preset)
    dummy = not any(path.glob("*.safetensors"))
    # (per-request flag, API): the async API is what `tandem bench` drives
    first = ((False, "sync"), (False, "async"))
    second = tuple((flag, api) for _ in range(2) for api in ("sync", "async") for flag in (False, True))
    for server_flag, flags in ((False, first), (True, second)):
        eng = Engine(model_path=str(path), load_format="dummy" if dummy else "auto", skip_tokenizer_init=True,
                     device=args.device, enable_return_routed_experts=server_flag)
        print(f"engine with --enable-return-routed-experts {server_flag}", flush=True)
        run(eng, args.num_prompts, flags)
        eng.shutdown()
        del eng
        free_memory(resolve_device(args.device))  # the next engine sizes its pool from what is free


def run(eng: Engine, num_prompts: int, flags: tuple) -> None:
    work = build_workload("random", num_prompts, 512, 256, eng.info.vocab_size, seed=1)
    eng.generate(input_ids=work.input_ids[:32], sampling_params=work.sampling_params()[:32],
                 return_routed_experts=any(flag for flag, _ in flags))  # warm-up
    for flag, api in flags:
        eng.flush_cache()
        for key in spent:
            spent[key] = 0.0
        start = time.perf_counter()
        kwargs = dict(input_ids=work.input_ids, sampling_params=work.sampling_params(), return_routed_experts=flag)
        outs = eng.generate(**kwargs) if api == "sync" else asyncio.run(_async_generate(eng, kwargs))
        wall = time.perf_counter() - start
        got = sum(1 for o in outs if "routed_experts" in o["meta_info"])
        print(f"{api:5} routes {'on ' if flag else 'off'}: {work.total_output_tokens / wall:,.1f} output tok/s, wall "
              f"{wall:.3f} s, copy to host {spent['read_routes']:.3f} s, read + encode {spent['encode']:.3f} s, {got} with routes",
              flush=True)


async def _async_generate(eng: Engine, kwargs: dict) -> list:
    return await eng.async_generate(stream=False, **kwargs)


if __name__ == "__main__":
    main()
