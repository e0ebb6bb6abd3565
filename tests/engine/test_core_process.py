"""The engine core in its own process (core_process=True) on the tiny model.

Oracle: the same engine with the core on a thread (outputs equal bit for bit from a cold cache);
weight updates are checked against an engine started on the new weights. A killed core process
must end in-flight requests and calls with a clear error within seconds, never a hang.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from engine.api.core_client import CoreDead
from tests.engine.conftest import random_prompts
from tests.hold import Hold
from engine.models.parallel_state import free_port

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def proc_engine(engine_factory):
    return engine_factory(core_process=True)


@pytest.fixture(scope="module")
def thread_engine(engine_factory):
    return engine_factory()


def _named_tensors(model_dir: str) -> list:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return [item for path in safetensors_files(model_dir) for item in load_file(path).items()]


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _leaves(entries: list) -> list:
    """SGLang's logprob entries, (logprob, id, text) each, from a list of them or of per-position lists."""
    out = []
    for e in entries:
        out.extend(_leaves(e) if isinstance(e, (list, tuple)) and e and isinstance(e[0], (list, tuple)) else [e])
    return out


def _ids_of(entries: list) -> list:
    return [e[1] if e else e for e in _leaves(entries)]


def _values_of(entries: list) -> list:
    return [e[0] for e in _leaves(entries) if e]


def test_outputs_equal_the_thread_core(proc_engine, thread_engine):
    assert proc_engine.local_core is None and proc_engine.client.process.is_alive()
    prompts = random_prompts(6, proc_engine.info.vocab_size, lengths=(3, 40), seed=11)
    params = [dict(GREEDY, max_new_tokens=4 + i) for i in range(6)]
    runs = []
    for eng in (thread_engine, proc_engine):
        eng.flush_cache()  # cold caches on both
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        text = eng.generate(prompt=["Hello world", "The cat"], sampling_params=GREEDY)
        stopped = eng.generate(prompt="Hello", sampling_params={"max_new_tokens": 30, "temperature": 0.0,
                                                                "stop": ["e", "a"]})
        runs.append((outs, text, stopped))
    (want, want_text, want_stop), (got, got_text, got_stop) = runs
    assert _ids(got) == _ids(want) and [len(o) for o in _ids(got)] == [4 + i for i in range(6)]
    assert [o["text"] for o in got] == [o["text"] for o in want]
    for key in ("finish_reason", "prompt_tokens"):
        assert [o["meta_info"][key] for o in got] == [o["meta_info"][key] for o in want]
    # the same ids, and logprobs equal to float32's last bits: bit for bit held on most runs, but a
    # full CI run twice saw one prompt's differ by ~3e-4 (2026-12-06; not reproduced alone, under
    # load or after the files before it: CPU BLAS kernels may vary with buffer alignment)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        for o_got, o_want in zip(got, want):
            assert _ids_of(o_got["meta_info"][key]) == _ids_of(o_want["meta_info"][key])
            assert _values_of(o_got["meta_info"][key]) == pytest.approx(_values_of(o_want["meta_info"][key]), abs=2e-3)
    assert [o["text"] for o in got_text] == [o["text"] for o in want_text] and got_text[0]["text"]
    assert got_stop["text"] == want_stop["text"] and got_stop["output_ids"] == want_stop["output_ids"]
    assert got_stop["meta_info"]["finish_reason"] == want_stop["meta_info"]["finish_reason"]


def test_a_batch_reaches_the_core_whole_however_slowly_it_is_pickled(proc_engine, thread_engine, monkeypatch):
    """A batch's requests are scheduled together: were the first sent before the rest are
    pickled, it would prefill alone and the batch's float32 logprobs would differ in their last
    bits from the thread core's (a busy host made test_outputs_equal_the_thread_core flaky so)."""
    import engine.api.process_client as process_client

    pickled = process_client._pickled

    def slowly(msg):
        time.sleep(0.03)
        return pickled(msg)

    prompts = random_prompts(6, proc_engine.info.vocab_size, lengths=(3, 40), seed=12)
    runs = []
    for eng in (thread_engine, proc_engine):
        eng.flush_cache()
        with monkeypatch.context() as patch:
            patch.setattr(process_client, "_pickled", slowly)
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        runs.append([o["meta_info"]["output_token_logprobs"] for o in outs])
    assert runs[1] == runs[0]


@pytest.mark.parametrize("stream", [False, True], ids=["final", "stream"])
def test_text_decoded_in_front_equals_the_core_detokenizer(proc_engine, stream):
    """The front end decodes text unless a request has stop strings; a stop string that never
    matches makes the core decode the same request: every chunk's text must be the same."""
    prompts = random_prompts(6, proc_engine.info.vocab_size, lengths=(2, 12), seed=8)
    never = {"stop": ["NEVER-MATCHES-\u00a7"]}

    async def run(params: dict) -> list[list[tuple[int, str]]]:
        chunks: list[list[tuple[int, str]]] = [[] for _ in prompts]
        gen = proc_engine.async_generate(input_ids=prompts, sampling_params=params, stream=stream)
        if not stream:
            return [[(len(o["output_ids"]), o["text"])] for o in await gen]
        async for chunk in gen:
            chunks[chunk["index"]].append((len(chunk["output_ids"]), chunk["text"]))
        return chunks

    front = asyncio.run(run(dict(GREEDY, max_new_tokens=12)))
    core = asyncio.run(run(dict(GREEDY, max_new_tokens=12, **never)))
    # a busy host may coalesce different stream chunks in the two runs: compare the text at every
    # token count both runs sent, and the final chunk
    for f, c in zip(front, core, strict=True):
        common = dict(f).keys() & dict(c).keys()
        assert f[-1] == c[-1] and len(common) >= min(len(f), len(c)) // 2
        assert {n: dict(f)[n] for n in common} == {n: dict(c)[n] for n in common}
    assert any(text for chunks in front for _, text in chunks)


def test_streaming_chunks_are_cumulative(proc_engine):
    async def run() -> list[dict]:
        stream = proc_engine.async_generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, stream=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        lengths = [len(c["output_ids"]) for c in mine]
        # one chunk per token unless the reader lagged (a busy host): then chunks coalesce
        assert lengths[-1] == 8 and lengths == sorted(set(lengths)) and len(lengths) >= 4, lengths
        for earlier, later in zip(mine, mine[1:]):  # cumulative: each chunk extends the one before
            assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_ends_a_running_request(proc_engine):
    chunks = proc_engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, rid="to-abort", stream=True)
    out = next(chunks)  # running, with its first token (not a fixed sleep: a loaded host may be slower)
    assert out["output_ids"]
    proc_engine.abort_request("to-abort")
    for out in chunks:
        pass
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    proc_engine.check_integrity()


def test_an_abort_while_the_request_is_built_reaches_the_core_process_after_it(proc_engine, monkeypatch):
    """The re-sent abort travels the same pipe as the request, behind it (engine/api/early_aborts.py)."""
    hold = Hold()
    monkeypatch.setattr(proc_engine.builder, "build", hold.around(proc_engine.builder.build))
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        out=proc_engine.generate(input_ids=[5, 6, 7], sampling_params=LONG, rid="built-late")))
    worker.start()
    assert hold.started.wait(30)
    proc_engine.abort_request(abort_all=True)
    hold.release.set()
    worker.join(timeout=30)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["out"]["output_ids"]) < LONG["max_new_tokens"]
    proc_engine.check_integrity()


def test_pause_and_continue(proc_engine):
    proc_engine.pause_generation("retract")
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (proc_engine.generate(input_ids=[4, 5], sampling_params=GREEDY),
                                               done.set()))
    waiting.start()
    time.sleep(0.5)
    assert not done.is_set(), "a request ran while the engine was paused"
    assert proc_engine.get_stats().paused and proc_engine.get_stats().num_waiting_reqs == 1
    proc_engine.continue_generation()
    waiting.join(timeout=30)
    assert done.is_set() and not proc_engine.get_stats().paused
    with pytest.raises(ValueError, match="pause mode"):
        proc_engine.pause_generation("later")


def test_weight_updates_from_tensors_and_disk(proc_engine, tiny_model_dir, other_model_dir, other_engine):
    prompts = random_prompts(3, proc_engine.info.vocab_size, lengths=(5, 30), seed=3)
    before = _ids(proc_engine.generate(input_ids=prompts, sampling_params=GREEDY))
    try:  # CPU tensors of this process reach the core by shared memory
        named = _named_tensors(other_model_dir)
        assert not any(t.is_shared() for _, t in named)
        ok, message = proc_engine.update_weights_from_tensor(named, weight_version="v1")
        assert ok and message == "Success. Weight version updated to v1.", message
        assert all(t.is_shared() for _, t in named)  # they went by shared memory, not by value
        after = proc_engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert _ids(after) == _ids(other_engine.generate(input_ids=prompts, sampling_params=GREEDY)) != before
        assert after[0]["meta_info"]["weight_version"] == "v1" == proc_engine.get_weight_version()
        ok, message = proc_engine.update_weights_from_tensor(
            [("model.layers.0.mlp.nope.weight", _named_tensors(other_model_dir)[0][1])])
        assert not ok and "unknown weight 'model.layers.0.mlp.nope.weight'" in message, message
    finally:
        ok, message, _ = proc_engine.update_weights_from_disk(tiny_model_dir, weight_version="default")
    assert ok, message
    assert _ids(proc_engine.generate(input_ids=prompts, sampling_params=GREEDY)) == before
    proc_engine.check_integrity()


def test_a_serialized_payload_is_opened_by_the_core_process(proc_engine, tiny_model_dir, other_model_dir,
                                                            other_engine):
    """The HTTP route's path: the payload stays serialized until the core process unpickles it
    (through the allowlist), as CUDA IPC handles must be; a refused class still refuses."""
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    prompts = random_prompts(2, proc_engine.info.vocab_size, lengths=(5, 30), seed=4)
    try:
        bucket = FlattenedBucket.pack(_named_tensors(other_model_dir)).to_payload()
        ok, message = proc_engine.update_weights_from_serialized(serialize(bucket, as_text=True), "flattened_bucket",
                                                                 weight_version="ser-1")
        assert ok, message
        assert _ids(proc_engine.generate(input_ids=prompts, sampling_params=GREEDY)) == _ids(
            other_engine.generate(input_ids=prompts, sampling_params=GREEDY))
        ok, message = proc_engine.update_weights_from_serialized(serialize([("x", os.system)]))
        assert not ok and "system" in message and "refused" in message, message
        assert proc_engine.get_weight_version() == "ser-1"
    finally:
        ok, message, _ = proc_engine.update_weights_from_disk(tiny_model_dir, weight_version="default")
    assert ok, message


def test_stats_and_server_info(proc_engine):
    proc_engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    stats = proc_engine.get_stats()
    assert stats.num_steps > 0 and stats.num_generated_tokens >= 8 and stats.kv_tokens_total > 0
    assert stats.num_running_reqs == 0 and stats.uptime_s > 0
    info = proc_engine.get_server_info()
    assert info["core_process"] is True and info["device"] == "cpu"
    assert info["vocab_size"] == proc_engine.info.vocab_size and info["internal_states"][0]["paused"] is False


def test_http_generate_over_a_core_process(proc_engine):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY, "return_logprob": True}
    with TestClient(create_app(proc_engine)) as client:
        resp = client.post("/generate", json=body)
        text = client.post("/generate", json={"text": "Hello world", "sampling_params": GREEDY})
    assert resp.status_code == 200 and text.status_code == 200
    proc_engine.flush_cache()
    direct = proc_engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True)
    assert resp.json()["output_ids"] == direct["output_ids"]
    assert text.json()["text"] == proc_engine.generate(prompt="Hello world", sampling_params=GREEDY)["text"]


def test_a_killed_core_fails_requests_and_calls_at_once(engine_factory):
    """An in-flight request and a call in progress (a rendezvous nobody joins) both end within
    seconds of a SIGKILL, naming the exit; later calls and requests raise CoreDead at once."""
    eng = engine_factory(core_process=True)
    result: dict = {}

    def wait_for_group() -> None:
        try:
            eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "never", "gloo")
        except Exception as exc:
            result["call_error"] = exc

    generating = threading.Thread(target=lambda: result.update(
        out=eng.generate(input_ids=[5, 6, 7], sampling_params=LONG)))
    generating.start()
    time.sleep(0.5)
    calling = threading.Thread(target=wait_for_group)
    calling.start()
    time.sleep(0.5)
    os.kill(eng.client.process.pid, signal.SIGKILL)
    generating.join(timeout=10)
    calling.join(timeout=10)
    assert not generating.is_alive(), "the in-flight request hung after the core died"
    assert not calling.is_alive(), "the pending call hung after the core died"
    reason = result["out"]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "core process exited" in reason["message"]
    assert "SIGKILL" in reason["message"]
    assert isinstance(result["call_error"], CoreDead) and "SIGKILL" in str(result["call_error"])
    assert not eng.is_alive()
    with pytest.raises(CoreDead, match="core process exited"):
        eng.get_stats()
    with pytest.raises(CoreDead, match="core process exited"):
        eng.generate(input_ids=[5, 6], sampling_params=GREEDY)
    eng.shutdown()  # quick, and safe to repeat


def test_start_up_failure_is_raised_in_the_parent(tmp_path):
    from engine import Engine

    started = time.perf_counter()
    with pytest.raises(OSError) as info:
        Engine(model_path=str(tmp_path / "no-such-model"), device="cpu", core_process=True)
    assert "engine core process during start-up" in "".join(getattr(info.value, "__notes__", []))
    assert time.perf_counter() - started < 120


class _NeedsTwoArgs(Exception):
    def __init__(self, a, b):  # pickles as (cls, (message,)), which cannot rebuild it
        super().__init__(f"{a} {b}")


def test_errors_that_do_not_rebuild_cross_as_runtime_errors():
    from engine.core.process_main import _portable_error

    plain = ValueError("bad")
    assert _portable_error(plain) is plain
    crossed = _portable_error(_NeedsTwoArgs("x", "y"))
    assert type(crossed) is RuntimeError and str(crossed) == "_NeedsTwoArgs: x y"


def test_an_engine_adopts_a_core_spawned_before_it(engine_factory, tiny_model_dir):
    """`tandem serve` spawns the core before its own imports (engine/api/core_spawn.py)."""
    from engine.api.core_spawn import spawn_core
    from engine.config import ServerArgs

    kwargs = {"model_path": tiny_model_dir, "dtype": "float32", "device": "cpu", "core_process": True}
    spawned = spawn_core(ServerArgs.from_kwargs(**kwargs))
    eng = engine_factory(spawned_core=spawned, **{k: v for k, v in kwargs.items() if k != "model_path"})
    assert eng.client.process is spawned.process and spawned.process.is_alive()
    out = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert len(out["output_ids"]) == 8


@pytest.mark.parametrize("core_process", [True, False])
def test_a_spawned_core_that_does_not_fit_is_stopped(tiny_model_dir, core_process):
    """Other server arguments, or a core on a thread: a clear error, and the spawned process ends."""
    from engine import Engine
    from engine.api.core_spawn import spawn_core
    from engine.config import ServerArgs

    spawned = spawn_core(ServerArgs.from_kwargs(model_path=tiny_model_dir, dtype="float32", device="cpu",
                                                core_process=True, max_running_requests=7))
    with pytest.raises(ValueError, match="spawned"):
        Engine(spawned_core=spawned, model_path=tiny_model_dir, dtype="float32", device="cpu",
               core_process=core_process)
    spawned.process.join(20)
    assert not spawned.process.is_alive()


def test_serve_spawns_the_core_early_only_for_a_core_process(tiny_model_dir):
    from tandem.serve import _spawn_core_early

    assert _spawn_core_early({"model_path": tiny_model_dir, "core_process": False}) is None
    spawned = _spawn_core_early({"model_path": tiny_model_dir, "device": "cpu", "core_process": True})
    try:
        assert spawned.process.is_alive() and spawned.server_args.model_path == tiny_model_dir
    finally:
        spawned.kill()
    assert not spawned.process.is_alive()


def test_an_empty_batch_sends_nothing_and_the_cores_serve_on(proc_engine, thread_engine):
    for eng in (thread_engine, proc_engine):
        eng.client.send_all([])
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]

