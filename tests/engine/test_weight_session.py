"""SGLang 0.5.23's Engine.begin_weight_update / end_weight_update / get_model_info in process, and
the same session behind the HTTP routes (Miles opens one around every sync): the pairing is
checked with SGLang's messages, updates go through inside a session, and the model info names
the checkpoint served after a disk update."""

from __future__ import annotations

import pytest


def test_the_session_pairs_and_the_model_info_follows_the_checkpoint(engine_factory, other_model_dir, tiny_model_dir):
    eng = engine_factory()
    info = eng.get_model_info()
    assert (info["model_path"], info["weight_version"], info["is_generation"]) == (tiny_model_dir, "default", True)
    assert eng.end_weight_update() == (False, "no weight-update session is open; call begin_weight_update() first")
    ok, message = eng.begin_weight_update("bogus")
    assert not ok and "selector must be one of target, draft, all" in message
    assert eng.begin_weight_update() == (True, "Success")
    assert eng.begin_weight_update("target") == (False, "a weight-update session is already open; "
                                                        "call end_weight_update() first")
    ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="v2")
    assert ok, message
    assert eng.end_weight_update() == (True, "Success")
    info = eng.get_model_info()
    assert (info["model_path"], info["weight_version"]) == (other_model_dir, "v2")


def test_the_routes_share_the_engine_s_session(engine_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    eng = engine_factory()
    with TestClient(create_app(eng)) as http:
        assert eng.begin_weight_update("all")[0]
        again = http.post("/begin_weight_update", json={"selector": "all"})
        assert again.status_code == 400 and "already open" in again.text
        assert http.post("/end_weight_update", json={}).status_code == 200
        assert eng.end_weight_update()[0] is False  # the route closed the engine's session
