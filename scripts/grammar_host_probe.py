"""Host costs of the grammar path on this machine (device probe, issue 13): thread hand-offs,
xgrammar fill/accept at 64 rows by thread count, the mask's copy + unpack, torch op launch cost."""
from __future__ import annotations

import json, random, statistics, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, "scripts")
import grammar_bench as gb  # noqa: E402
import torch  # noqa: E402
import xgrammar  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from engine.grammar.bitmask_ring import BitmaskRing  # noqa: E402
from engine.grammar.compiler import GrammarCompiler  # noqa: E402

out = {}


def t(f, n=200):
    xs = []
    for _ in range(n):
        s = time.perf_counter(); f(); xs.append(time.perf_counter() - s)
    return round(statistics.median(xs) * 1e6, 1)


model = gb.build_model(Path("/tmp/q06-bigvocab"))
tok = AutoTokenizer.from_pretrained(str(model))
V = 151936
cg = GrammarCompiler(tok, V, [tok.eos_token_id]).compile("json_schema", json.dumps(gb.SCHEMA))
rng = random.Random(0)
shifts = torch.arange(32, dtype=torch.int32)
one = xgrammar.allocate_token_bitmask(1, V)
live = []
for i in range(64):
    m = xgrammar.GrammarMatcher(cg)
    for _ in range(rng.randint(0, 80)):
        m.fill_next_token_bitmask(one, 0)
        bits = ((one[0].unsqueeze(-1) >> shifts) & 1).reshape(-1)[:V].nonzero().flatten().tolist()
        nxt = rng.choice(bits)
        if nxt == tok.eos_token_id:
            break
        m.accept_token(nxt)
    live.append(m)
bm = xgrammar.allocate_token_bitmask(64, V)
rows = list(range(64))
for thr in (1, 2, 4, 8, 16):
    b = xgrammar.BatchGrammarMatcher(max_threads=thr)
    out[f"fill64_threads{thr}_us"] = t(lambda: b.batch_fill_next_token_bitmask(live, bm, rows), 50)
per = sorted(t(lambda m=m, i=i: m.fill_next_token_bitmask(bm, i), 5) for i, m in enumerate(live))
out["fill_per_row_us"] = {"median": per[32], "p90": per[57], "max": per[-1], "sum": round(sum(per), 1)}
toks = []
for i, m in enumerate(live):
    m.fill_next_token_bitmask(bm, i)
    toks.append(rng.choice(((bm[i].unsqueeze(-1) >> shifts) & 1).reshape(-1)[:V].nonzero().flatten().tolist()))
out["accept64_batch_plus_rollback_us"] = t(lambda: (xgrammar.BatchGrammarMatcher.batch_accept_token(live, toks), xgrammar.BatchGrammarMatcher.batch_rollback(live, 1)))
out["rollback64_us"] = t(lambda: None)
pool = ThreadPoolExecutor(1)
pool.submit(lambda: 0).result()


def handoff():
    e = threading.Event(); f = pool.submit(e.set); e.wait(); f.result()


out["executor_event_round_trip_us"] = t(handoff)
out["executor_submit_result_us"] = t(lambda: pool.submit(lambda: 0).result())
ring = BitmaskRing(V, "cuda")
x = torch.randn(64, V, device="cuda")


def to_dev():
    b = ring.take(64)
    m = ring.to_device(b)
    return x.masked_fill(m, float("-inf"))


to_dev(); torch.cuda.synchronize()
out["ring_take_to_device_maskfill_us"] = t(to_dev)
out["torch_add_launch_us"] = t(lambda: x.add_(0))
torch.cuda.synchronize()
print(json.dumps(out, indent=1))

# the core thread's own grammar work, piece by piece (engine code, real matchers, CUDA ring)
from engine.grammar.mask_prefetch import MaskPrefetch  # noqa: E402
from engine.grammar.matcher import RequestGrammar, accept_tokens  # noqa: E402
from engine.grammar.stream_gate import StreamGate  # noqa: E402
from engine.grammar.vocab_mask import prepare_fill  # noqa: E402

grammars = []
for m in live:
    g = RequestGrammar(cg)
    g.matcher = m
    grammars.append(g)
dead = [None if i % 8 == 0 else g for i, g in enumerate(grammars)]
core = {}
core["ring_take_us"] = t(lambda: ring.take(64))
core["prepare_fill_all_live_us"] = t(lambda: prepare_fill(grammars, ring))
core["prepare_fill_8_dead_us"] = t(lambda: prepare_fill(dead, ring))
core["accept_tokens_plus_rollback_us"] = t(lambda: (accept_tokens(grammars, toks), xgrammar.BatchGrammarMatcher.batch_rollback(live, 1)))
gate = StreamGate.create("cuda")
core["gate_wait_us"] = t(lambda: gate.wait(0))
for g in (None, gate):
    mp = MaskPrefetch(g)
    key = "gated" if g else "host"

    def cycle(mp=mp):
        batch = object()
        mp.start(batch, grammars, ring)
        b = mp.take(batch)
        ring.to_device(b)
        mp.drop()

    core[f"prefetch_cycle_{key}_us"] = t(cycle, 50)

    def start_only(mp=mp):
        batch = object()
        s = time.perf_counter(); mp.start(batch, grammars, ring); d = time.perf_counter() - s
        mp.drop()
        return d

    core[f"start_{key}_us"] = round(statistics.median(start_only() for _ in range(50)) * 1e6, 1)
    mp.shutdown()
b = ring.take(64)
core["to_device_us"] = t(lambda: ring.to_device(b))
torch.cuda.synchronize()
print(json.dumps(core, indent=1))
