"""freeze_gc (engine/gc_freeze.py): SGLang's Engine.freeze_gc and /freeze_gc. The objects alive at
the call leave the collector (gc.get_freeze_count), in the front end and in the core's own process;
the core process freezes its start-up objects by itself. Every test here unfreezes the pytest
process again: frozen objects that later become cyclic garbage would never be collected."""

from __future__ import annotations

import gc

import pytest

from engine.core.messages import FreezeGCReq


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_thread_core_engine_freezes_this_process(engine_factory, unfrozen):
    eng = engine_factory()
    assert gc.get_freeze_count() == 0
    eng.freeze_gc()
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # torch, the model, the engine: all of start-up's objects
    assert eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})["output_ids"]


def test_the_core_process_freezes_at_start_up_and_when_asked(engine_factory, unfrozen):
    eng = engine_factory(core_process=True)
    assert eng._call(FreezeGCReq()) > 10_000  # start-up's objects, frozen before the first request
    eng.freeze_gc()
    assert gc.get_freeze_count() > 0
    out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0.0})
    assert len(out["output_ids"]) == 3


def test_the_route_answers_as_sglang_and_needs_the_admin_key(engine_factory, unfrozen):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    eng = engine_factory()
    with TestClient(create_app(eng)) as client:
        for method in ("GET", "POST"):
            resp = client.request(method, "/freeze_gc")
            assert resp.status_code == 200 and resp.text == "Garbage collection frozen.\n"
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    with TestClient(create_app(eng, api_key="user", admin_api_key="admin")) as client:
        assert client.post("/freeze_gc", headers={"Authorization": "Bearer user"}).status_code == 401
        assert gc.get_freeze_count() == 0
        assert client.post("/freeze_gc", headers={"Authorization": "Bearer admin"}).status_code == 200
    assert gc.get_freeze_count() > 0
