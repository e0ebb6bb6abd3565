"""`tandem bench`: flags, and the order of a benchmark run.

Order matters for memory on a GPU: the device rates are measured before the engine takes its
share of memory; the HF model is built only after the engine (and its KV pool) is gone, from the
engine model's weights, which are all that is kept.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from typing import Any, Optional

from tandem.bench.lora_mode import add_lora_arguments, check_lora_flags
from tandem.bench.tandem_run import STREAM_MODES
from tandem.bench.workload import WORKLOADS, Workload, build_workload
from tandem.preset_model import add_preset_argument, engine_kwargs_from_args

logger = logging.getLogger("tandem")
GRPO_DEFAULT_N = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.server_args import add_server_args

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: independent prompts; grpo: each prompt sampled --n times")
    g.add_argument("--num-prompts", type=int, default=256, help="distinct prompts")
    g.add_argument("--input-len", type=int, default=512, help="prompt tokens (the maximum when mixed)")
    g.add_argument("--output-len", type=int, default=256, help="output tokens (the maximum when mixed)")
    g.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths uniform in [ratio * len, len]; 1.0 = fixed lengths")
    g.add_argument("--n", type=int, default=None,
                   help=f"grpo: samples per prompt, sharing it (default {GRPO_DEFAULT_N})")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts' random token ids")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (what --compare-hf checks); 1.0 samples as RL rollouts do")
    m = p.add_argument_group("model")
    add_preset_argument(m)
    add_lora_arguments(p.add_argument_group("LoRA"))
    h = p.add_argument_group("HTTP serving")
    h.add_argument("--url", default=None, metavar="http://HOST:PORT",
                   help="drive a running server's /generate instead of an in-process engine: one "
                   "request per prompt (input_ids), all at once, as rollout workers send them")
    h.add_argument("--serve", action="store_true",
                   help="measure in-process, then start `tandem serve` with the same engine flags and "
                   "measure it over HTTP; report both and their ratio")
    h.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="extra flags for the served engine only, e.g. '--core-process'")
    r = p.add_argument_group("measurement")
    r.add_argument("--runs", "--num-runs", dest="runs", type=int, default=3,
                   help="measured runs; the median is reported")
    r.add_argument("--warmup-runs", type=int, default=1, help="unmeasured runs first (other prompts)")
    r.add_argument("--stream-mode", choices=STREAM_MODES, default="stream",
                   help="stream: TTFT/ITL and throughput from streamed runs; final: final "
                   "results only (no per-token messages, no TTFT/ITL); both: each run twice, "
                   "throughput from final, latency from stream")
    r.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate on the same weights, in this process")
    r.add_argument("--hf-runs", type=int, default=None, help="measured HF runs (default: --runs)")
    r.add_argument("--hf-num-prompts", type=int, default=None, metavar="N",
                   help="HF generates the workload's first N requests only (default: all); its rate is "
                        "per its own tokens. For models whose HF copy and batch do not fit beside the engine's")
    r.add_argument("--roofline", action="store_true",
                   help="measure copy bandwidth and matmul rate; print the workload's floor")
    r.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    r.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the measured runs, one more under torch.profiler: print its top N "
                   "kernels by time and their share of the wall time")
    add_server_args(p, require_model_path=False)


def run_bench(args: argparse.Namespace) -> int:
    from tandem.bench.report import format_table, write_json

    bench = Bench(args)
    try:
        result = bench.run()
    finally:
        if bench.lora is not None:
            bench.lora.cleanup()
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.runs < 1 or (args.hf_runs is not None and args.hf_runs < 1) or args.warmup_runs < 0:
            raise SystemExit("tandem bench: --runs and --hf-runs must be >= 1, --warmup-runs >= 0")
        if args.hf_num_prompts is not None and args.hf_num_prompts < 1:
            raise SystemExit("tandem bench: --hf-num-prompts must be >= 1")
        if args.compare_hf and args.temperature != 0.0:
            raise SystemExit("tandem bench: --compare-hf runs greedy generation; drop --temperature "
                             "(or --compare-hf to measure sampling alone)")
        _check_http_flags(args)
        check_lora_flags(args)
        self.args = args
        self.engine_kwargs, self.model_label = _engine_kwargs(args) if not args.url else ({}, args.url)
        self.n = args.n or (GRPO_DEFAULT_N if args.workload == "grpo" else 1)
        self._engine_model: Any = None
        self._tandem_output_ids: list[list[int]] = []
        self.lora: Any = None  # tandem.bench.lora_mode.LoRABench with --lora-adapters

    def run(self) -> dict[str, Any]:
        import torch

        from engine.core.setup import resolve_device

        if self.args.url:
            from tandem.bench.http_phase import run_against_url

            return run_against_url(self)

        device = resolve_device(self.engine_kwargs.get("device", "auto"))
        vocab = self._check_model_limits()
        workload = self._workload(vocab, self.args.seed)  # bad sizes fail here, before any model loads
        warmup = self._workload(vocab, self.args.seed + 1)  # other prompts: no cache carry-over
        workload, warmup = self._add_adapters(workload), self._add_adapters(warmup)
        rates = self._measure_rates(device)
        result = self._header(device, torch.__version__)
        result["lora"] = self.lora.describe() if self.lora else {"adapters": 0}
        self._run_tandem(result, device, rates, workload, warmup)
        if self.args.compare_hf:
            self._save_partial(result)
            self._run_hf(result, workload, device)
        self._engine_model = None
        if self.args.serve:
            from tandem.bench.http_phase import run_served

            run_served(self, result, workload, warmup)
        return result

    # ---- phases --------------------------------------------------------------------------------
    def _measure_rates(self, device: Any) -> Optional[Any]:
        if not self.args.roofline:
            return None
        from tandem.bench.device import free_memory
        from tandem.bench.roofline import measure_device

        rates = measure_device(device)
        free_memory(device)  # hand the test tensors' blocks back before the engine sizes its pool
        logger.info("device rates: copy %.2f TB/s, matmul %.1f TFLOP/s",
                    rates.copy_bandwidth_bytes_s / 1e12, rates.matmul_flops_s / 1e12)
        return rates

    def _run_tandem(self, result: dict, device: Any, rates: Any, workload: Workload,
                    warmup: Workload) -> None:
        from engine import Engine
        from tandem.bench import device as dev
        from tandem.bench.stats import median_of_runs, ratio
        from tandem.bench.tandem_run import measure

        started = time.perf_counter()
        engine = Engine(**self.engine_kwargs)
        result["engine_startup_s"] = time.perf_counter() - started  # load, pool, graph capture
        try:
            for _ in range(self.args.warmup_runs):
                measure(engine, warmup, device, self.args.stream_mode)
            outcomes = []
            for i in range(self.args.runs):
                outcomes.append(measure(engine, workload, device, self.args.stream_mode))
                logger.info("tandem run %d/%d: %.1f output tok/s", i + 1, self.args.runs,
                            outcomes[-1].metrics["output_tok_s"])
            runs = [o.metrics for o in outcomes]
            result["tandem"] = {"median": median_of_runs(runs), "runs": runs}
            self._tandem_output_ids = outcomes[-1].output_ids
            if self.args.profile > 0:
                self._profile(result, engine, workload, device)
            self._describe_engine(result, engine, workload)
            if rates is not None:
                self._add_roofline(result, engine, workload, rates)
            # only the weights outlive the engine (for the HF copy); the KV pool goes with it
            self._engine_model = engine.local_core.runner.model if self.args.compare_hf else None
        finally:
            engine.shutdown()
        del engine
        dev.free_memory(device)
        logger.info("engine shut down; %.2f GiB still allocated", dev.allocated_gb(device))
        result["ratios"]["tandem_over_roofline"] = ratio(
            result["tandem"]["median"]["output_tok_s"], (result.get("roofline") or {}).get("output_tok_s"))

    def _run_hf(self, result: dict, workload: Workload, device: Any) -> None:
        from tandem.bench import device as dev
        from tandem.bench.hf_baseline import agreement, build_hf_model, run_hf
        from tandem.bench.stats import median_of_runs, ratio

        dtype = next(self._engine_model.parameters()).dtype
        hf_model = None
        try:
            hf_model = build_hf_model(self.engine_kwargs["model_path"], self._engine_model, dtype, device)
            self._engine_model = None  # the HF model holds its own copy now
            dev.free_memory(device)
            hf = run_hf(hf_model, workload.head(self.args.hf_num_prompts), device, self.args.hf_runs or self.args.runs)
        except (RuntimeError, ValueError) as exc:  # OOM included: keep tandem's numbers
            logger.exception("HF baseline failed")
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
            return
        finally:
            del hf_model
            dev.free_memory(device)
        median = median_of_runs(hf["runs"])
        result["hf"] = {"median": median, "runs": hf["runs"], "attn_implementation": hf["attn_implementation"],
                        "num_requests": len(hf["output_ids"] or [])}
        result["ratios"]["tandem_over_hf"] = ratio(result["tandem"]["median"]["output_tok_s"],
                                                   median["output_tok_s"])
        result["ratios"]["hf_agreement"] = agreement(self._tandem_output_ids, hf["output_ids"])

    def _profile(self, result: dict, engine: Any, workload: Workload, device: Any) -> None:
        from tandem.bench.profile import format_profile, profile_run

        result["profile"] = profile_run(engine, workload, device, self.args.stream_mode, self.args.profile)
        print(format_profile(result["profile"]))

    # ---- pieces --------------------------------------------------------------------------------
    def _save_partial(self, result: dict) -> None:
        """tandem's numbers on disk before the (slow) HF baseline, in case the run is cut short."""
        if self.args.json:
            from tandem.bench.report import write_json

            write_json(self.args.json, {**result, "partial": "tandem measured; HF baseline unfinished"})

    def _workload(self, vocab_size: int, seed: int) -> Workload:
        a = self.args
        try:
            return build_workload(a.workload, a.num_prompts, a.input_len, a.output_len,
                                  vocab_size, a.random_range_ratio, self.n, seed, a.temperature)
        except ValueError as exc:
            raise SystemExit(f"tandem bench: {exc}") from exc

    def _add_adapters(self, workload: Workload) -> Workload:
        """--lora-adapters: written and set in the engine's flags once; requests round-robin over them."""
        from tandem.bench.lora_mode import prepare_lora

        if self.lora is None:
            self.lora = prepare_lora(self.args, self.engine_kwargs)
        if self.lora is None:
            return workload
        return workload.with_adapters(self.lora.request_adapters(workload.num_requests))

    def _check_model_limits(self) -> int:
        """-> vocab size; exits early when prompt + output cannot fit the context."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.engine_kwargs["model_path"])
        context = self.args.context_length or getattr(config, "max_position_embeddings", 4096)
        if self.args.input_len + self.args.output_len > context:
            raise SystemExit(f"tandem bench: --input-len + --output-len exceeds the context length "
                             f"{context} (raise --context-length)")
        return int(config.vocab_size)

    def _header(self, device: Any, torch_version: str) -> dict[str, Any]:
        from tandem.bench.device import device_name

        return {
            "command": shlex.join(sys.argv), "args": vars(self.args), "model": self.model_label,
            "device": device_name(device), "torch_version": torch_version,
            "transformers_version": _transformers_version(), "ratios": {},
        }

    def _describe_engine(self, result: dict, engine: Any, workload: Workload) -> None:
        import dataclasses

        info = engine.info  # the core's own report: the core may run in another process
        result.update(
            workload=workload.describe(), dtype=info.dtype, attention_backend=info.attention_backend,
            server_args=dataclasses.asdict(engine.server_args),
            engine_limits={"max_total_num_tokens": info.max_total_num_tokens,
                           "max_running_requests": info.max_running_requests,
                           "chunked_prefill_size": info.chunked_prefill_size},
        )

    def _add_roofline(self, result: dict, engine: Any, workload: Workload, rates: Any) -> None:
        from tandem.bench.roofline import floor, max_decode_batch, model_shape

        model, memory = engine.local_core.runner.model, engine.local_core.parts.memory
        shape = model_shape(model, model.config, memory.bytes_per_token)
        batch = max_decode_batch(workload, memory.max_running_requests, memory.max_total_num_tokens)
        cascade = engine.local_core.runner.shared_prefix is not None and not engine.server_args.disable_radix_cache
        result["roofline"] = floor(workload, shape, rates, batch, shared_prefix=cascade)


def _check_http_flags(args: argparse.Namespace) -> None:
    """Flags that need the engine's model in this process cannot go with a server or a core process."""
    if args.url and args.serve:
        raise SystemExit("tandem bench: give --url (a running server) or --serve (start one), not both")
    local = [flag for flag, on in (("--compare-hf", args.compare_hf), ("--roofline", args.roofline),
                                   ("--profile", args.profile > 0)) if on]
    remote = "--url" if args.url else "--core-process" if getattr(args, "core_process", False) else None
    if local and remote:
        raise SystemExit(f"tandem bench: {', '.join(local)} read(s) the model in this process; drop "
                         f"{remote} or {local[0]}")


def _engine_kwargs(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    return engine_kwargs_from_args(args, "bench")


def _transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__
