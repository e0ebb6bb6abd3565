"""/weights_checker and Engine.check_weights: Miles' --check-weight-update-equal sequence
(shared/reference/sglang-rl-api.md, "Weight checks"): snapshot, reset_tensors, the sync, compare.

Oracles: a compare right after a reset must fail and name the tensors; after a sync of the very
checkpoint the snapshot came from it must pass; checksums equal those of an engine loaded fresh
from the same files and differ after a reset.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.server.http import create_app


def test_miles_check_weight_update_equal_sequence(engine_factory, tiny_model_dir):
    eng = engine_factory()
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    want = eng.generate(input_ids=[5, 6, 7], sampling_params=greedy)["output_ids"]
    with TestClient(create_app(eng)) as c:
        snap = c.post("/weights_checker", json={"action": "snapshot"})
        assert snap.status_code == 200 and snap.json()["success"], snap.text
        before = c.post("/weights_checker", json={"action": "checksum"}).json()
        reset = c.post("/weights_checker", json={"action": "reset_tensors"})
        assert reset.status_code == 200 and reset.json()["success"], reset.text
        mismatch = c.post("/weights_checker", json={"action": "compare", "allow_quant_error": False, "selector": "all"})
        assert mismatch.status_code == 400 and not mismatch.json()["success"]
        assert "embed_tokens" in mismatch.json()["message"], mismatch.text
        after_reset = c.post("/weights_checker", json={"action": "checksum"}).json()
        assert after_reset["per_engine_checksum"] != before["per_engine_checksum"]
        ok, message, _ = eng.update_weights_from_disk(tiny_model_dir)  # the trainer's sync: every tensor again
        assert ok, message
        equal = c.post("/weights_checker", json={"action": "compare", "allow_quant_error": False, "selector": "all"})
        assert equal.status_code == 200 and equal.json()["success"], equal.text
        again = c.post("/weights_checker", json={"action": "checksum"}).json()
    assert again["ranks"][0]["checksums"] == before["ranks"][0]["checksums"]
    assert again["ranks"][0]["parallelism_info"][0]["rank"] == 0
    assert all(len(v) == 16 for v in again["ranks"][0]["checksums"].values())
    buffers = [n for n, _ in eng.local_core.runner.model.named_buffers()]
    assert any("inv_freq" in n for n in buffers)  # a rotary cache is there: derived, never synced, so not checked
    assert not any("inv_freq" in n for n in again["ranks"][0]["checksums"])
    assert eng.generate(input_ids=[5, 6, 7], sampling_params=greedy)["output_ids"] == want


def test_skip_list_and_partial_sync(engine_factory):
    """A tensor the sync did not rewrite fails the compare, unless listed in skip_tensor_list."""
    eng = engine_factory()
    model = eng.local_core.runner.model
    name = "model.norm.weight"
    assert eng.check_weights("snapshot")["success"]
    eng.check_weights("reset_tensors", skip_tensor_list=[name])  # left as it was
    assert eng.check_weights("compare", skip_tensor_list=[])["success"] is False
    # "sync" everything but the norm from the snapshot's values: only the norm then matches...
    snapshot = eng.local_core.weight_reads.checker._snapshot
    for key, tensor in model.named_parameters():
        if key != name:
            tensor.data.copy_(snapshot[key])
    assert eng.check_weights("compare")["success"]  # the norm was skipped by the reset, so it matches too
    model.get_parameter(name).data.add_(1.0)
    result = eng.check_weights("compare")
    assert not result["success"] and name in result["message"]
    assert eng.check_weights("compare", skip_tensor_list=[name])["success"]
    assert eng.check_weights("compare", allow_quant_error=True)["success"] is False  # 1.0 is no rounding error


def test_bad_actions_are_clear_errors(engine_factory):
    eng = engine_factory()
    with pytest.raises(ValueError, match="needs a snapshot first"):
        eng.check_weights("compare")
    with pytest.raises(ValueError, match="unknown weights_checker action 'explode'"):
        eng.check_weights("explode")
    with TestClient(create_app(eng, admin_api_key="adm")) as c:
        assert c.post("/weights_checker", json={"action": "checksum"}).status_code == 401  # a control route
        resp = c.post("/weights_checker", json={"action": "explode"}, headers={"Authorization": "Bearer adm"})
        assert resp.status_code == 400 and "explode" in resp.text
        assert c.post("/weights_checker", headers={"Authorization": "Bearer adm"}).json()["success"]  # no body: checksum


def test_reset_drops_the_prefix_cache_and_waits_for_running_requests(engine_factory):
    """Nothing computed with the old weights serves the random ones: a reset empties the prefix
    cache, and is refused while a request holds KV (paused in place here)."""
    import threading
    import time

    eng = engine_factory()
    core = eng.local_core
    eng.generate(input_ids=list(range(5, 60)), sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    assert core.scheduler.tree_cache.total_size() > 0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (eng.generate(input_ids=[5, 6, 7], sampling_params={
        "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}), done.set()))
    worker.start()
    deadline = time.monotonic() + 30
    while not core.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.005)
    eng.pause_generation(mode="in_place")
    with pytest.raises(ValueError, match="while requests hold KV"):
        eng.check_weights("reset_tensors")
    eng.continue_generation()
    assert done.wait(60)
    worker.join()
    assert eng.check_weights("reset_tensors")["success"]
    assert core.scheduler.tree_cache.total_size() == 0
    eng.check_integrity()
