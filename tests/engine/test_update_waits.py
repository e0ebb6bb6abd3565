"""A weight update sent while requests run, not paused (SGLang's writer lock, sglang-rl-api.md 1.1):
it waits until the running requests end, so every token of theirs is the old weights', requests
sent meanwhile start under the new ones, and the update succeeds. Updates behind it keep their
order; an abort or a pause lets it land at once.

Oracles: greedy tokens of the same prompt on an engine that only ever had the old or the new
weights; the per-token weight_versions spans each answer carries.
"""

from __future__ import annotations

import threading
import time

import pytest

# long enough (seconds on a CPU) that the checks made while it runs never race its end
LONG = {"max_new_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
SHORT = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def eng(engine_factory):
    return engine_factory()


@pytest.fixture(scope="module")
def greedy(eng, other_model_dir):
    """Greedy output ids of (PROMPT, SHORT) under each checkpoint's weights, nothing else running."""
    out = {}
    for name, path in (("new", other_model_dir), ("old", eng.server_args.model_path)):
        ok, message, _ = eng.update_weights_from_disk(path)
        assert ok, message
        out[name] = eng.generate(input_ids=PROMPT, sampling_params=SHORT)["output_ids"]
    assert out["old"] != out["new"]  # the update is visible in the tokens
    return out


def _in_background(fn) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _held(eng) -> bool:
    return eng.local_core.scheduler.admission.admit_before is not None


def _held_updates(eng) -> int:
    return len(eng.client._worker._held_updates)


def _restore(eng) -> None:
    ok, message, _ = eng.update_weights_from_disk(eng.server_args.model_path, weight_version="default")
    assert ok, message
    eng.check_integrity()


def _start_long(eng) -> tuple[threading.Thread, list]:
    running, result = _in_background(lambda: eng.generate(input_ids=PROMPT, sampling_params=LONG))
    _wait_for(lambda: eng.local_core.scheduler.running, "the long request to run")
    return running, result


def _versions(out: dict) -> set[str]:
    return {span["version"] for span in out["meta_info"]["weight_versions"]}


def test_an_unpaused_update_waits_for_the_running_request(eng, greedy, other_model_dir):
    running, first = _start_long(eng)
    update, reply = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    later, second = _in_background(lambda: eng.generate(input_ids=PROMPT, sampling_params=SHORT))
    _wait_for(lambda: eng.local_core.scheduler.waiting, "the later request to queue")
    assert eng.local_core.scheduler.running and not reply  # still generating, the update not applied
    for thread in (running, update, later):
        thread.join(timeout=120)
    assert reply[0] == (True, "Succeeded to update model weights.", 0), reply
    assert len(first[0]["output_ids"]) == LONG["max_new_tokens"] and _versions(first[0]) == {"default"}
    assert second[0]["output_ids"] == greedy["new"] and _versions(second[0]) == {"v1"}
    assert not _held(eng)
    _restore(eng)


def test_held_updates_land_in_order(eng, greedy, other_model_dir):
    running, first = _start_long(eng)
    ahead, reply_ahead = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    # no flush: alone it would land between two steps; behind the held one it waits its turn
    behind, reply_behind = _in_background(lambda: eng.update_weights_from_disk(
        eng.server_args.model_path, weight_version="v2", flush_cache=False))
    _wait_for(lambda: _held_updates(eng) == 2, "the second update to be held behind the first")
    assert eng.get_weight_version() == "default"
    for thread in (running, ahead, behind):
        thread.join(timeout=120)
    assert reply_ahead[0][0] and reply_behind[0][0], (reply_ahead, reply_behind)
    assert eng.get_weight_version() == "v2" and _versions(first[0]) == {"default"}
    assert eng.generate(input_ids=PROMPT, sampling_params=SHORT)["output_ids"] == greedy["old"]
    _restore(eng)


@pytest.mark.parametrize("how", ["abort", "pause_abort", "pause_retract"])
def test_ending_the_running_request_lets_a_held_update_land(eng, greedy, other_model_dir, how):
    running, first = _start_long(eng)
    update, reply = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    if how == "abort":
        eng.abort_request(abort_all=True)
    else:
        eng.pause_generation(how.removeprefix("pause_"))
    update.join(timeout=60)
    assert reply and reply[0][0], reply
    eng.continue_generation()
    running.join(timeout=120)
    out = first[0]
    if how == "pause_retract":  # back to the queue, then finished under the new weights
        assert len(out["output_ids"]) == LONG["max_new_tokens"] and _versions(out) == {"default", "v1"}
    else:
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and _versions(out) <= {"default"}
    assert eng.generate(input_ids=PROMPT, sampling_params=SHORT)["output_ids"] == greedy["new"]
    _restore(eng)


def test_an_update_paused_in_place_is_still_refused(eng, other_model_dir):
    running, first = _start_long(eng)
    eng.pause_generation("in_place")
    try:
        ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="v1")
        assert not ok and "paused in_place" in message, message
    finally:
        eng.continue_generation()
    running.join(timeout=120)
    assert _versions(first[0]) == {"default"} and eng.get_weight_version() == "default"


@pytest.mark.parametrize("core_process", [False, True])
def test_shutdown_ends_a_held_update_and_the_request_it_waits_for(engine_factory, core_process):
    """Neither caller waits forever: the update raises CoreDead, the request ends with a 503 abort
    (a thread core's stop used to leave in-process generate calls waiting)."""
    from engine.api.core_client import CoreDead

    eng = engine_factory(core_process=core_process)
    running, first = _in_background(lambda: eng.generate(input_ids=PROMPT, sampling_params=LONG))
    _wait_for(lambda: eng.get_stats().num_running_reqs, "the long request to run")

    def update():
        try:
            return eng.update_weights_from_disk(eng.server_args.model_path)
        except CoreDead as exc:
            return exc

    held, reply = _in_background(update)
    if core_process:
        time.sleep(0.3)  # the update reaches the core and is held there (not visible from here)
    else:
        _wait_for(lambda: _held(eng), "the update to be held")
    eng.shutdown()
    running.join(timeout=10)
    held.join(timeout=10)
    assert isinstance(reply[0], CoreDead), reply
    assert first[0]["meta_info"]["finish_reason"]["status_code"] == 503, first


def test_a_request_queued_before_the_update_still_runs_on_the_old_weights(engine_factory, other_model_dir):
    """SGLang's writer lock waits for every request sent before the update, started or not: one
    waiting for a running slot (max_running_requests=1) runs on the old weights, then the update
    lands, then the request sent after it runs on the new ones (a GRPO group is never split)."""
    eng = engine_factory(max_running_requests=1)
    running, first = _start_long(eng)
    queued, second = _in_background(lambda: eng.generate(input_ids=PROMPT, sampling_params=SHORT))
    _wait_for(lambda: eng.local_core.scheduler.waiting, "the second request to queue")
    update, reply = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    later, third = _in_background(lambda: eng.generate(input_ids=PROMPT, sampling_params=SHORT))
    for thread in (running, queued, update, later):
        thread.join(timeout=120)
    assert reply[0][0], reply
    assert _versions(first[0]) == _versions(second[0]) == {"default"}
    assert _versions(third[0]) == {"v1"}


def test_an_update_is_not_held_while_generation_is_stopped(eng, other_model_dir):
    """Released graph memory stops generation: the running request could not end, so the update
    is refused at once (it was held until the resume)."""
    running, first = _start_long(eng)
    ok, message = eng.release_memory_occupation(["cuda_graph"])
    assert ok, message
    try:
        start = time.monotonic()
        ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="v1")
        assert not ok and "still hold KV" in message and time.monotonic() - start < 5, message
    finally:
        eng.resume_memory_occupation(["cuda_graph"])
    running.join(timeout=120)
    assert _versions(first[0]) == {"default"}


def test_a_held_update_lands_as_soon_as_the_last_request_ends(eng, other_model_dir):
    """Not after the idle loop's half-second wait for a message."""
    running, first = _start_long(eng)
    update, reply = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    running.join(timeout=120)
    ended = time.monotonic()
    update.join(timeout=30)
    assert reply[0][0] and time.monotonic() - ended < 0.3, (reply, time.monotonic() - ended)
    _restore(eng)


def test_health_generate_answers_while_an_update_is_held(eng, other_model_dir):
    """The probe waits behind the update; the core steps, so it is healthy (as SGLang's probe)."""
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    running, first = _start_long(eng)
    update, reply = _in_background(lambda: eng.update_weights_from_disk(other_model_dir, weight_version="v1"))
    _wait_for(lambda: _held(eng), "the update to be held")
    with TestClient(create_app(eng)) as client:
        start = time.monotonic()
        assert client.get("/health_generate").status_code == 200
        assert time.monotonic() - start < 5
    for thread in (running, update):
        thread.join(timeout=120)
    assert reply[0][0], reply
    _restore(eng)


def test_an_http_update_waits_for_a_running_request_of_a_core_process(engine_factory, other_model_dir, tiny_model_dir):
    """SGLang's unpaused update over HTTP: 200 once the running request has ended, every one of its
    tokens the old weights' (the route used to answer 400 while a request held KV)."""
    pytest.importorskip("httpx")
    proc_engine = engine_factory(core_process=True)
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    params = dict(SHORT, max_new_tokens=1000)  # seconds on a CPU: the update arrives while it runs
    result: list = []
    runner = threading.Thread(target=lambda: result.append((proc_engine.generate(
        input_ids=[5, 6, 7], sampling_params=params), time.monotonic())))
    runner.start()
    deadline = time.monotonic() + 30
    while proc_engine.get_stats().num_running_reqs == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with TestClient(create_app(proc_engine)) as client:
        assert proc_engine.get_stats().num_running_reqs == 1  # still generating as the update is sent
        resp = client.post("/update_weights_from_disk", json={"model_path": other_model_dir, "weight_version": "v1"})
        answered = time.monotonic()
    runner.join(timeout=60)
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.json()
    out, ended = result[0]
    assert answered > ended - 0.5  # the update waited for the request (seconds long; 0.5 s: thread wake-ups)
    assert len(out["output_ids"]) == 1000 and [s["version"] for s in out["meta_info"]["weight_versions"]] == ["default"]
    assert proc_engine.get_weight_version() == "v1"
    ok, message, _ = proc_engine.update_weights_from_disk(tiny_model_dir, weight_version="default")
    assert ok, message
