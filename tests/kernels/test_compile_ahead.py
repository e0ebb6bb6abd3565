"""CompileAhead (engine/kernels/compile_ahead.py) on a machine without a GPU.

A stand-in for Triton's active driver names the H200's target (sm_90) and launches nothing, so
Triton's JIT path (specialization, its hooks, compiles into the on-disk cache) runs for real on
the CPU. Checked: a dry pass launches and compiles nothing on its own thread, the pool's compiles
land in the cache under the keys the JIT computes (the warm-up that follows writes no new entry),
a kernel compiled before the pass ends it instead of launching, the hooks are restored after
(tests/kernels/sm90_subprocess.py: the stand-in driver, the subprocess).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from tests.kernels.sm90_subprocess import STAND_IN_DRIVER, run_for_sm90  # noqa: E402

SCRIPT = STAND_IN_DRIVER + r"""
import os, threading, time
import torch
import triton
from triton import knobs
from engine.kernels.compile_ahead import CompileAhead
from engine.kernels.greedy_logprob import greedy_logprob
from engine.kernels.store_kv import store_kv

cache = os.environ["TRITON_CACHE_DIR"]
entries = lambda: sum(len(files) for _, _, files in os.walk(cache))

def store(t):  # a decode step's K/V store, bf16
    k = torch.zeros(t, 8, 128, dtype=torch.bfloat16)
    pool = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
    store_kv(k, k.clone(), pool, pool.clone(), torch.zeros(t, dtype=torch.int64))

def passes():
    for t in (1, 16, 24):  # Triton specializes t's strides, not the grid
        store(t)
    greedy_logprob(torch.zeros(4, 1000))

ahead = CompileAhead(workers=2)
start = time.perf_counter()
with ahead.dry_pass():
    assert ahead.run(passes)
    seen = []  # another thread's compiles and launches are its own
    other = threading.Thread(target=lambda: seen.append((knobs.runtime.jit_cache_hook(key=None, fn=None, compile={}),
                                                         knobs.runtime.launch_enter_hook({}))))
    other.start(); other.join()
    assert seen == [(None, None)], seen
report = ahead.wait()
assert not report.failed, report.failed
assert report.submitted == 3, report.submitted  # store_kv once, greedy's two kernels
assert knobs.runtime.jit_cache_hook is None and not knobs.runtime.launch_enter_hook.calls  # restored
print(f"compiled {report.submitted} kernels in {report.seconds:.2f} s")

# the JIT's own compile of the same calls now loads from the cache: no new entry
before = entries()
from engine.kernels import store_kv as sk
k = torch.zeros(16, 8, 128, dtype=torch.bfloat16)
pool = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
args = (k, k.clone(), pool, pool.clone(), torch.zeros(16, dtype=torch.int64), *k.stride()[:2], *k.stride()[:2],
        *pool.stride()[:2], *pool.stride()[:2])
t0 = time.perf_counter()
sk._store_kv_kernel.warmup(*args, HKV=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, num_warps=4, grid=(16,))
assert entries() == before, (entries(), before)
print(f"cache hit in {time.perf_counter() - t0:.3f} s")

# compiled in memory now: a dry pass stops at its launch instead of launching
ahead = CompileAhead(workers=1)
with ahead.dry_pass():
    assert not ahead.run(lambda: store(16))
assert ahead.wait().submitted == 0
print("stopped at a compiled kernel")
"""


def test_dry_pass_compiles_on_the_pool_into_the_cache(tmp_path):
    done = run_for_sm90(SCRIPT, cache_dir=tmp_path / "triton-cache")
    assert "stopped at a compiled kernel" in done.stdout


RUNNER_SCRIPT = r"""
import os, sys
import torch
import importlib, pkgutil
import engine.attention.triton, engine.kernels, engine.kernels.batch_invariant
for pkg in (engine.kernels, engine.kernels.batch_invariant):  # every kernel jitted, none interpreted
    for mod in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(mod.name)

os.environ["TRITON_INTERPRET"] = "1"  # only the backend's device check reads it now
from engine import Engine
from engine.runner import cuda_graph
from engine.runner.cuda_graph import CudaGraphRunner

eng = Engine(model_path=sys.argv[1], device="cpu", dtype="bfloat16", attention_backend="triton",
             disable_cuda_graph=True, max_total_tokens=4096)
runner = eng.local_core.runner
passes = []
CudaGraphRunner._capture_all = lambda self: passes.append(self._compile_ahead())  # the dry pass alone
logged = []
cuda_graph.logger.info = lambda msg, *args: logged.append(msg % args)
cuda_graph.logger.warning = lambda msg, *args: logged.append("WARNING " + msg % args)
""" + STAND_IN_DRIVER + r"""
with torch.inference_mode():
    CudaGraphRunner(runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token, runner.device, 24)
print(logged)
assert passes and len(logged) == 1 and "ahead of capture" in logged[0] and "failed" not in logged[0], logged
assert int(logged[0].split("compiled ")[1].split()[0]) >= 3, logged  # the K/V store, attention, norm + rope
eng.shutdown()
"""


def test_the_graph_runner_dry_pass_over_a_decoder(tmp_path):
    """CudaGraphRunner._compile_ahead over a tiny bf16 decoder with the Triton attention backend on
    the CPU: the decode passes of sizes 24..1 run dry (no Python error, nothing launched) and the
    kernels they reach compile for sm_90 without a failure."""
    from engine.testing.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", preset="tiny")
    run_for_sm90(RUNNER_SCRIPT, str(model), cache_dir=tmp_path / "triton-cache")


LAYERS_SCRIPT = RUNNER_SCRIPT.split("print(logged)")[0] + r"""
import contextlib
import engine.kernels.compile_ahead as ca
walks, wait = [], ca.CompileAhead.wait
def recording_wait(self):
    walks.append({(name, str(ident[1])) for ident, (name, _) in self._futures.items()})
    return wait(self)
ca.CompileAhead.wait = recording_wait
layers = runner.model.model.layers
visited = []
hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: visited.append(i)) for i, layer in enumerate(layers)]
with torch.inference_mode():  # the default: the first and last of 5 layers
    CudaGraphRunner(runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token, runner.device, 24)
assert set(visited) == {0, 4}, sorted(set(visited))
for hook in hooks:
    hook.remove()
CudaGraphRunner._end_layers_only = lambda self: contextlib.nullcontext()
with torch.inference_mode():  # every layer
    CudaGraphRunner(runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token, runner.device, 24)
assert runner.model.model.layers is layers and len(layers) == 5
assert len(walks) == 2 and len(walks[0]) >= 3, [len(w) for w in walks]
assert walks[0] == walks[1], sorted(name for name, _ in walks[0] ^ walks[1])
print(sorted(name for name, _ in walks[0]))
eng.shutdown()
"""


def test_a_dry_pass_through_the_end_layers_reaches_every_kernel(tmp_path):
    """The dry pass walks a dense decoder's first and last layers only (the others launch the
    same kernels on the same shapes): the kernels it hands to the pool are those a walk through
    all five layers of a tiny bf16 decoder hands over."""
    import json

    from engine.testing.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", preset="tiny")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=5)))
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # the walk reads no weights: dummy ones of the 5-layer shape
    script = LAYERS_SCRIPT.replace('max_total_tokens=4096', 'max_total_tokens=4096, load_format="dummy"')
    run_for_sm90(script, str(model), cache_dir=tmp_path / "triton-cache")


def test_the_pool_size_is_the_cpus_or_what_the_variable_says(monkeypatch):
    from engine.kernels.compile_ahead import MAX_WORKERS, WORKERS_ENV, _pool_size

    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert 1 <= _pool_size() <= MAX_WORKERS
    monkeypatch.setenv(WORKERS_ENV, " 4")
    assert _pool_size() == 4
    for bad in ("0", "four", "\u00b2", "-2"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            _pool_size()


def test_the_switch_refuses_unknown_values(monkeypatch, tmp_path):
    from engine.kernels.compile_ahead import ENV, compile_ahead_wanted

    marker = tmp_path / "marker"
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        compile_ahead_wanted(marker)
    monkeypatch.setenv(ENV, "1")
    assert compile_ahead_wanted(marker) and compile_ahead_wanted(None)
    monkeypatch.setenv(ENV, "0")
    assert not compile_ahead_wanted(marker)
    monkeypatch.delenv(ENV)  # auto: where no earlier start left the marker
    assert compile_ahead_wanted(marker)
    marker.touch()
    assert not compile_ahead_wanted(marker)
    assert not compile_ahead_wanted(None)  # no Triton cache to look in: only when asked


def test_the_marker_names_the_kernels_and_the_shape(monkeypatch, tmp_path):
    """graphs_marker lives in Triton's cache dir; another shape, launch mode or kernel source is
    another marker, so a start after any of them compiles ahead again."""
    from triton import knobs

    from engine.kernels import compile_ahead

    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    shape = {"dims": [1024, 16, 8], "capture_bs": [1, 2, 4]}
    marker = compile_ahead.graphs_marker(shape)
    assert marker.parent == tmp_path and marker == compile_ahead.graphs_marker(dict(shape))
    assert compile_ahead.graphs_marker({**shape, "capture_bs": [1, 2]}) != marker
    monkeypatch.setenv("TANDEM_PDL", "0")
    assert compile_ahead.graphs_marker(shape) != marker
    monkeypatch.delenv("TANDEM_PDL")
    for other in ("TANDEM_API_KEY", "TANDEM_COMPILE_AHEAD", "TANDEM_GRAPH_WARMUPS"):  # no kernel switch
        monkeypatch.setenv(other, "1")
        assert compile_ahead.graphs_marker(shape) == marker, other
        monkeypatch.delenv(other)
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "k.py").write_text("x = 1")
    monkeypatch.setattr(compile_ahead, "_KERNEL_DIR", kernels)
    edited = compile_ahead.graphs_marker(shape)
    (kernels / "k.py").write_text("x = 2")
    assert compile_ahead.graphs_marker(shape) != edited
    compile_ahead.mark_compiled(marker)
    assert marker.exists()
