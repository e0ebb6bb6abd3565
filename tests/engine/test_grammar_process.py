"""The grammar process backend (engine/grammar/matcher_server.py, matcher_client.py) on the CPU.

Oracle: the thread backend. Both fill the same masks from the same matchers, and a row's token
depends only on its logits, mask, seed and position, so every seeded output must be identical.
"""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("xgrammar")

from tests.engine.test_grammar import CODE, PROMPTS, SCHEMA, check_schema, sampled  # noqa: E402


@pytest.fixture(scope="module")
def engines(engine_factory):
    return engine_factory(grammar_backend="thread"), engine_factory(grammar_backend="process")


def _batch(n: int) -> list[dict]:
    """Constrained rows of three kinds and free rows, in one batch."""
    params = sampled(n, 32, regex=CODE) + sampled(n, 48, json_schema=json.dumps(SCHEMA)) + sampled(n, 16)
    return [{**p, "sampling_seed": 7 + i} for i, p in enumerate(params)]


def test_outputs_equal_the_thread_backend(engines):
    thread, process = engines
    params = _batch(6)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    expected = thread.generate(prompts, params)
    got = process.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    for out in got[:6]:
        assert re.fullmatch(CODE, out["text"]), out["text"]
    for out in got[6:12]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            check_schema(out["text"])
    client = process.local_core.runner.grammar_masks
    assert client._seq > 0 and client._generation == 0  # the steps went through the process, never lost


def test_a_process_killed_while_idle_is_replaced(engines):
    _, process = engines
    client = process.local_core.runner.grammar_masks
    process.generate(PROMPTS[0], sampled(1, 8, regex=CODE)[0])  # the process is up
    client._process.kill()
    client._process.join(5)
    out = process.generate(PROMPTS[1], sampled(1, 8, regex=CODE)[0])
    assert re.fullmatch(CODE, out["text"]), out


def test_a_process_killed_mid_request_aborts_its_requests_and_the_engine_serves_on(engines, monkeypatch):
    _, process = engines
    client = process.local_core.runner.grammar_masks
    accept, calls = type(client).accept, []

    def accept_then_kill(self, grammars, tokens):
        calls.append(1)
        if len(calls) == 3:  # mid-request: the process dies with matchers in it
            self._process.kill()
            self._process.join(5)
        return accept(self, grammars, tokens)

    monkeypatch.setattr(type(client), "accept", accept_then_kill)
    outs = process.generate(PROMPTS[:2], sampled(2, 40, regex="[a-z]{30}"))
    monkeypatch.undo()
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out
        assert "grammar process was lost" in out["meta_info"]["finish_reason"]["message"]
    again = process.generate(PROMPTS[1], sampled(1, 8, regex=CODE)[0])
    assert re.fullmatch(CODE, again["text"]), again
    free = process.generate(PROMPTS[2], {"max_new_tokens": 4})
    assert len(free["output_ids"]) == 4
    process.local_core.scheduler.check_integrity()


def test_the_shared_ring_grows_past_its_first_capacity(engines):
    """It lives in memfds, not /dev/shm (Docker caps that at 64 MB; this ring reaches ~78 MB at
    1024 rows of a 152k vocabulary)."""
    thread, process = engines
    shm_before = _python_shm_names()
    params = [{**p, "sampling_seed": i} for i, p in enumerate(sampled(80, 6, regex=CODE))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(80)]
    assert [o["output_ids"] for o in process.generate(prompts, params)] == \
        [o["output_ids"] for o in thread.generate(prompts, params)]
    segment = process.local_core.runner.grammar_masks._segment
    assert segment.capacity >= 80
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:tandem-grammar-masks")
    assert _python_shm_names() <= shm_before


def _python_shm_names() -> set[str]:
    """multiprocessing.shared_memory's segments (its names start with psm_), as the ring once used."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")} if os.path.isdir("/dev/shm") else set()


def test_under_the_core_process(tiny_model_dir):
    """`tandem serve`'s layout: the core in its own process starts the grammar process."""
    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, device="cpu", dtype="float32", core_process=True,
                 grammar_backend="process")
    try:
        outs = eng.generate(PROMPTS[:2], sampled(2, 16, regex=CODE))
        assert all(re.fullmatch(CODE, o["text"]) for o in outs), [o["text"] for o in outs]
    finally:
        eng.shutdown()


def test_auto_is_the_thread_backend_on_the_cpu(engine_factory):
    """"auto" (the default) picks the process only on a GPU (tests/gpu/test_grammar_gpu.py)."""
    from engine.grammar.mask_prefetch import MaskPrefetch

    eng = engine_factory()
    assert eng.local_core.server_args.grammar_backend == "auto"
    assert type(eng.local_core.runner.grammar_masks) is MaskPrefetch


def test_auto_picks_the_process_only_on_a_gpu_with_xgrammar(monkeypatch):
    import importlib.util

    import torch

    from engine.grammar.matcher_client import grammar_backend_for

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert grammar_backend_for("auto", cuda) == "process"
    assert grammar_backend_for("auto", cpu) == "thread"
    assert grammar_backend_for("process", cpu) == "process"  # asked for: the CPU runs it too
    assert grammar_backend_for("thread", cuda) == "thread"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "xgrammar" else find_spec(name))
    assert grammar_backend_for("auto", cuda) == "thread"  # no process started for a package that is missing


def test_a_script_without_a_main_guard_runs_once(tmp_path, tiny_model_dir):
    """The grammar process is a fresh `python -m` child, not multiprocessing's spawn (which re-runs
    the user's __main__ in it: a script with no guard would build a second engine there)."""
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text(
        "print('top-level ran', flush=True)\n"
        "from engine import Engine\n"
        f"eng = Engine(model_path={tiny_model_dir!r}, device='cpu', dtype='float32', grammar_backend='process')\n"
        f"out = eng.generate('hi', {{'max_new_tokens': 8, 'regex': {CODE!r}, 'temperature': 1.0}})\n"
        "print('OUT', out['text'], flush=True)\n"
        "eng.shutdown()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top-level ran") == 1, done.stdout
    (text,) = [line[len("OUT "):] for line in done.stdout.splitlines() if line.startswith("OUT ")]
    assert re.fullmatch(CODE, text), text


def test_a_process_lost_with_a_fill_in_flight_leaves_an_all_allowing_mask(engines, monkeypatch):
    """The gated path (CUDA) hands the device the buffer before the fill; if the process is then lost,
    the core writes -1 into it before opening the gate, so no row is sampled under a stale mask."""
    import signal

    class OpenGate:  # the device would wait on the word; here nothing waits
        def wait(self, seq: int) -> bool:
            return True

    _, process = engines
    client = process.local_core.runner.grammar_masks
    process.generate(PROMPTS[0], sampled(1, 8, regex=CODE)[0])  # the process is up, its ring written
    grammar = client.new("regex", CODE, [])
    monkeypatch.setattr(client, "step_timeout_s", 1.0)
    monkeypatch.setattr(client, "gate", OpenGate())
    for _ in range(4):  # every ring slot holds a stale, all-forbidding mask
        client.ring.take(2).fill_(0)
    os.kill(client._process.pid, signal.SIGSTOP)  # alive, silent
    batch = object()
    client.start(batch, [grammar, None])
    mask = client.take(batch)
    client.drop()  # times out: lost
    assert client._process is None and (mask == -1).all()
    monkeypatch.undo()
    out = process.generate(PROMPTS[1], sampled(1, 8, regex=CODE)[0])  # a new process serves on
    assert re.fullmatch(CODE, out["text"]), out


def test_paths_as_path_objects(tiny_model_dir, monkeypatch):
    """A pathlib.Path model path, and one on sys.path, reach the grammar process as strings."""
    import sys
    from pathlib import Path

    from engine import Engine

    monkeypatch.setattr(sys, "path", [*sys.path, Path(tiny_model_dir)])
    eng = Engine(model_path=Path(tiny_model_dir), device="cpu", dtype="float32", grammar_backend="process")
    try:
        out = eng.generate(PROMPTS[0], sampled(1, 8, regex=CODE)[0])
        assert re.fullmatch(CODE, out["text"]), out
    finally:
        eng.shutdown()
