"""Constrained vs unconstrained decoding throughput, same engine, same call (issue 13, GPU).

Qwen3-0.6B shape with random weights (`--load-format dummy`); nothing is downloaded, so the
tokenizer is tandem's tiny BPE grown to a Qwen-sized vocabulary (151,600 entries) with synthetic
byte-level tokens (words with and without a leading space, capitalised words, digit runs,
punctuation and JSON-ish runs such as `":"`): xgrammar's mask work scales with the vocabulary and
its structure, so a 1k vocabulary would flatter the constrained run. The free run generates the
very lengths the constrained run produced (ignore_eos), so the two differ only by the grammar; a
free run to the full --output-len is reported too. Reported: output tok/s of each (median of
--runs), the ratio, host seconds in the grammar's work, outputs that parse and validate against
the schema, and the compile times (tokenizer info, first compile, cached compile).
Usage: python scripts/grammar_bench.py [--batch 64] [--runs 3] [--variants prefetch,noprefetch] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["active", "pending", "closed", "archived"]},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "contact": {"type": "object", "properties": {
                "email": {"type": "string", "maxLength": 32},
                "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
                "required": ["email", "phone"], "additionalProperties": False}},
            "required": ["name", "role", "contact"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "urgent", "later"]},
                 "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4},
        "priority": {"enum": [1, 2, 3]},
    },
    "required": ["id", "status", "owner", "tags", "scores", "priority"],
    "additionalProperties": False,
}
VOCAB = 151_600


def grow_vocab(model_dir: Path, size: int, seed: int = 0) -> None:
    """Append synthetic byte-level tokens to tokenizer.json's BPE vocabulary up to `size` ids."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max(list(vocab.values()) + [t["id"] for t in data.get("added_tokens", [])]) + 1
    enc = _bytes_to_unicode()
    rng = random.Random(seed)
    letters, punct = "etaoinshrdlcumwfgypbvkjxqz", "{}[]\":,.-_/'()<>!?;=+*#@$%&|\\"
    while next_id < size:
        kind = rng.random()
        if kind < 0.55:
            word = "".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 10)))
            text = (" " if rng.random() < 0.6 else "") + (word.capitalize() if rng.random() < 0.2 else word)
        elif kind < 0.7:
            text = (" " if rng.random() < 0.3 else "") + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        else:
            text = "".join(rng.choice(punct + " ") for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.4:
                text += rng.choice(letters) * rng.randint(1, 3)
        token = "".join(enc[b] for b in text.encode())
        if token not in taken:
            taken.add(token)
            vocab[token] = next_id
            next_id += 1
    path.write_text(json.dumps(data))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what the ByteLevel pre-tokenizer maps each byte to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_model(out: Path) -> Path:
    if not (out / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "tandem.main", "tiny-model", "--out", str(out),
                        "--preset", "qwen3-0.6b"], check=True, stdout=subprocess.DEVNULL)
        grow_vocab(out, VOCAB)
    return out


def compile_times(model_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from engine.grammar.compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, 151936, [tokenizer.eos_token_id])
    info_s = time.perf_counter() - start
    spec = json.dumps(SCHEMA)
    start = time.perf_counter()
    compiler.compile("json_schema", spec)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile("json_schema", spec)
    return {"tokenizer_info_s": info_s, "first_compile_s": first_s, "cached_compile_s": time.perf_counter() - start,
            "tokenizer_vocab": len(tokenizer)}


def run(eng, prompts, params) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    return tokens / seconds, outs


def _timed_run(eng, timers, prompts, params, rates: list, host: list) -> list[dict]:
    timers.take()
    ahead = eng.local_core.stats.num_lookahead_steps
    masks = eng.local_core.runner.grammar_masks
    taken = masks.num_taken
    start = time.perf_counter()
    rate, outs = run(eng, prompts, params)
    host.append({**timers.take(), "wall": time.perf_counter() - start,
                 "lookahead_steps": eng.local_core.stats.num_lookahead_steps - ahead,
                 "prefetched_masks": masks.num_taken - taken})
    rates.append(rate)
    return outs


def valid(outs: list[dict]) -> dict:
    import jsonschema

    complete = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    ok, lenient, failures = 0, 0, []
    for o in complete:
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"text": o["text"], "error": str(exc)[:300]})
        try:  # strict=False: control characters inside strings allowed
            jsonschema.validate(json.loads(o["text"], strict=False), SCHEMA)
            lenient += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"complete": len(complete), "valid": ok, "valid_allowing_control_chars": lenient,
            "total": len(outs), "failures": failures[:2],
            "mean_len": statistics.mean(len(o["output_ids"]) for o in outs)}


class HostTimers:
    """Seconds the core spends in the grammar's host work (the engine runs on a thread here)."""

    def __init__(self) -> None:
        import engine.core.engine_core as core
        import engine.grammar.mask_prefetch as prefetch
        import engine.runner.model_runner as runner
        from engine.grammar.bitmask_ring import BitmaskRing
        from engine.sampling.sampler import Sampler
        from engine.sampling.sampling_batch import SamplingBatch

        # mask: fills on the core thread; mask_background: fills on the prefetch thread (overlapped);
        # prefetch_start: the core's hand-off to that thread; prefetch_take: its wait for the fill;
        # mask_to_device: copy + unpack; sampling_build / sampler: the sampling set-up and kernels
        # (inside sample, as the mask's parts are); accept: matchers advanced (inside process)
        self.seconds = dict.fromkeys(["mask", "mask_background", "prefetch_start", "prefetch_take", "mask_to_device",
                                      "accept", "sampling_build", "sampler", "sample", "process",
                                      "prefetch_prepare"], 0.0)
        self._wrap(prefetch, "fill_bitmask", "mask")
        self._wrap(prefetch, "run_fill", "mask_background")
        self._wrap(prefetch.MaskPrefetch, "start", "prefetch_start")
        self._wrap(prefetch.MaskPrefetch, "take", "prefetch_take")
        self._wrap(BitmaskRing, "to_device", "mask_to_device")
        self._wrap(prefetch, "accept_tokens", "accept")
        import engine.grammar.matcher_client as client  # the process backend's share of the same work
        self._wrap(client.MatcherClient, "accept", "accept")
        self._wrap(client.MatcherClient, "start", "prefetch_start")
        self._wrap(client.MatcherClient, "take", "prefetch_take")
        self._wrap(client.MatcherClient, "drop", "prefetch_drop")
        self._wrap(SamplingBatch, "build", "sampling_build")
        self._wrap(Sampler, "sample_with_distributions", "sampler")
        self._wrap(runner.ModelRunner, "_sample", "sample")
        self._wrap(core.EngineCore, "_process", "process")
        self._wrap(prefetch, "prepare_fill", "prefetch_prepare")
        self.seconds["prefetch_drop"] = 0.0  # the core joining the worker (with a gate: the fill's wait)
        self._wrap(prefetch.MaskPrefetch, "drop", "prefetch_drop")
        from engine.scheduler.scheduler import Scheduler
        self.seconds["schedule_lookahead"] = 0.0
        self._wrap(Scheduler, "schedule_lookahead", "schedule_lookahead")
        self._trace_handoffs(prefetch)

    def _trace_handoffs(self, prefetch) -> None:
        """worker_start_delay: start called -> the worker runs (prepare included); worker_return_delay:
        take called or xgrammar's fill done, whichever is later -> take has the mask (the worker's
        way back through the GIL)."""
        self.seconds.update(worker_start_delay=0.0, worker_return_delay=0.0)
        marks: dict = {}
        start, take, run_job = prefetch.MaskPrefetch.start, prefetch.MaskPrefetch.take, prefetch.MaskPrefetch._run

        def traced_start(mp, *args, **kwargs):
            marks["start"] = time.perf_counter()
            return start(mp, *args, **kwargs)

        def traced_run(job):
            self.seconds["worker_start_delay"] += time.perf_counter() - marks.pop("start", time.perf_counter())
            try:
                return run_job(job)
            finally:
                marks["filled"] = time.perf_counter()

        def traced_take(mp, batch):
            called = time.perf_counter()
            out = take(mp, batch)
            if "filled" in marks:  # from whichever came last, take called or fill done, to the mask in hand
                self.seconds["worker_return_delay"] += time.perf_counter() - max(called, marks.pop("filled"))
            return out

        prefetch.MaskPrefetch.start, prefetch.MaskPrefetch.take = traced_start, traced_take
        prefetch.MaskPrefetch._run = staticmethod(traced_run)

    def _wrap(self, owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict:
        out, self.seconds = self.seconds, dict.fromkeys(self.seconds, 0.0)
        return out


def apply_variant(name: str, eng) -> None:
    """prefetch (the default) | nogate (prefetch, but sampling waits for the fill on the host:
    no StreamGate) | noprefetch (every mask filled on the core thread) | threadsN
    (prefetch, xgrammar filling with N threads; its default is half the host's cores) | switchN
    (prefetch, CPython's GIL switch interval N us instead of 5000) | torchthreadsN (prefetch,
    torch's CPU ops on N threads: its idle OpenMP threads spin on cores xgrammar fills on)."""
    import torch
    import xgrammar

    import engine.grammar.vocab_mask as vocab_mask
    from engine.runner.model_runner import ModelRunner

    kind = name.rstrip("0123456789")  # prefetch2, nogate2: the same variant measured again
    masks = eng.local_core.runner.grammar_masks
    if masks.gate is not None:  # the engine's own (the process backend makes its gate on first use)
        _GATE.setdefault("gate", masks.gate)
    masks.gate = None if kind in ("nogate", "noprefetch") else _GATE.get("gate", masks.gate)
    # nowaitN: start returns without waiting for the worker, CPython's switch interval N us
    masks.hand_off = not name.startswith("nowait")
    switch = name[len("switch"):] if name.startswith("switch") else name[len("nowait"):] if not masks.hand_off else ""
    sys.setswitchinterval(int(switch) * 1e-6 if switch else 0.005)
    ModelRunner.prefetch_grammar_mask = _PREFETCH if kind != "noprefetch" else lambda self, batch: None
    torch.set_num_threads(int(name[len("torchthreads"):]) if name.startswith("torchthreads") else _TORCH_THREADS)
    threads = int(name[len("threads"):]) if name.startswith("threads") else "auto"
    vocab_mask._batch_matcher = lambda: _MATCHERS.setdefault(threads, xgrammar.BatchGrammarMatcher(max_threads=threads))


_MATCHERS: dict = {}
_GATE: dict = {}
_PREFETCH = None
_TORCH_THREADS = 0


def measure(eng, timers, prompts, free, constrained, runs: int) -> dict:
    # like for like: the free run generates exactly the lengths the constrained run produced
    # (ignore_eos), so both drain the batch the same way and differ only by the grammar
    rates: dict[str, list[float]] = {"free": [], "json_schema": [], "free_full_length": []}
    host: dict[str, list[dict]] = {k: [] for k in rates}
    timed = lambda name, params: _timed_run(eng, timers, prompts, params, rates[name], host[name])  # noqa: E731
    same_lengths = lambda outs: [{**p, "max_new_tokens": len(o["output_ids"]), "ignore_eos": True}  # noqa: E731
                                 for p, o in zip(free, outs)]
    # warm (compile, graphs, allocator, the variant's threads); seeded: every constrained run samples these outputs
    outs = run(eng, prompts, constrained)[1]
    for i in range(runs):  # the pair's order alternates, so a drift of the host's speed cancels out
        if i % 2:
            timed("free", same_lengths(outs))
            outs = timed("json_schema", constrained)
        else:
            outs = timed("json_schema", constrained)
            timed("free", same_lengths(outs))
        timed("free_full_length", free)
    tok_s = {k: statistics.median(v) for k, v in rates.items()}
    return {"tok_s": tok_s, "runs_tok_s": rates, "host_seconds": host,
            "ratio": tok_s["json_schema"] / tok_s["free"],
            "ratio_vs_full_length": tok_s["json_schema"] / tok_s["free_full_length"],
            "outputs": valid(outs), "sample": outs[0]["text"][:300]}


def profile_pair(eng, prompts, free, constrained, top: int) -> dict:
    """One constrained run, then a free run of its lengths, each under torch.profiler: their top
    kernels (the device's share of the wall time: below 1.0 it waited for the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tandem.bench.profile import format_profile, kernel_table

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    out, outs = {}, None
    for name in ("json_schema", "free"):
        params = constrained if outs is None else [
            {**p, "max_new_tokens": len(o["output_ids"]), "ignore_eos": True} for p, o in zip(free, outs)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rate, run_outs = run(eng, prompts, params)
        outs = outs or run_outs
        wall = sum(len(o["output_ids"]) for o in run_outs) / rate
        out[name] = {**kernel_table(prof, wall, top), "output_tok_s": rate}
        print(name, format_profile(out[name]), sep="\n", flush=True)
    return out


def main() -> None:
    global _PREFETCH, _TORCH_THREADS
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/q06-bigvocab")
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine-args", default="{}", help="JSON of extra Engine kwargs")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the last variant, one constrained run and one free run of its lengths under "
                             "torch.profiler (CUDA): the top N kernels of each")
    parser.add_argument("--variants", default="prefetch",
                        help="comma-separated, measured in turn on one engine: prefetch | nogate | noprefetch "
                             "(the A/B of engine/grammar/mask_prefetch.py) | threadsN (xgrammar's fill threads)")
    args = parser.parse_args()
    from engine import Engine
    from engine.runner.model_runner import ModelRunner

    import torch

    _PREFETCH = ModelRunner.prefetch_grammar_mask
    _TORCH_THREADS = torch.get_num_threads()
    model_dir = build_model(Path(args.model_dir))
    report = {"compile": compile_times(model_dir), "batch": args.batch, "schema": SCHEMA, "variants": {}}
    print("compile:", report["compile"], flush=True)
    timers = HostTimers()
    eng = Engine(model_path=str(model_dir), load_format="dummy", **json.loads(args.engine_args))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(args.input_len)] for _ in range(args.batch)]
    base = {"max_new_tokens": args.output_len, "temperature": 1.0}
    free = [{**base, "sampling_seed": i} for i in range(args.batch)]
    constrained = [{**base, "sampling_seed": i, "json_schema": json.dumps(SCHEMA)} for i in range(args.batch)]
    try:
        run(eng, prompts, free)
        for name in args.variants.split(","):
            apply_variant(name, eng)
            result = measure(eng, timers, prompts, free, constrained, args.runs)
            report["variants"][name] = result
            print(name, {k: result[k] for k in ("tok_s", "ratio", "outputs")}, flush=True)
        if args.profile:
            report["profile"] = profile_pair(eng, prompts, free, constrained, args.profile)
    finally:
        eng.shutdown()
    print(json.dumps({k: v for k, v in report.items() if k != "schema"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
