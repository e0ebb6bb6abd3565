"""Keys: --api-key guards generation and info, --admin-api-key the control routes; keys from the
environment; a loud warning when exposed without keys; hostile Authorization headers are 401s."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tandem.serve import exposure_warning, with_env_keys
from engine.server.http import create_app

GEN = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


def bearer(key) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_key_guards_control_routes_only(engine_factory):
    eng = engine_factory()
    with TestClient(create_app(eng, api_key="gen", admin_api_key="admin")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/generate", json=GEN).status_code == 401
        assert c.post("/generate", json=GEN, headers=bearer("gen")).status_code == 200
        assert c.get("/v1/models", headers=bearer("gen")).status_code == 200
        # the rollout key cannot take the engine over
        for path in ("/pause_generation", "/flush_cache", "/update_weight_version",
                     "/start_profile", "/release_memory_occupation"):
            resp = c.post(path, json={}, headers=bearer("gen"))
            assert resp.status_code == 401 and "admin api key" in resp.json()["message"], path
        assert eng.get_stats().paused is False
        assert c.post("/pause_generation", json={"mode": "retract"}, headers=bearer("admin")).status_code == 200
        assert eng.get_stats().paused is True
        assert c.post("/continue_generation", headers=bearer("admin")).status_code == 200
        assert c.post("/generate", json=GEN, headers=bearer("admin")).status_code == 200  # admin may generate


def test_the_rollout_key_aborts_by_rid_but_not_everything(engine_factory):
    """A rollout worker holding the generation key ends its own long tail (SGLang's api key
    allows /abort_request); abort_all, every client's requests, takes the admin key."""
    eng = engine_factory()
    with TestClient(create_app(eng, api_key="gen", admin_api_key="admin")) as c:
        assert c.post("/abort_request", json={"rid": "mine"}).status_code == 401  # no key at all
        assert c.post("/abort_request", json={"rid": "mine"}, headers=bearer("gen")).status_code == 200
        resp = c.post("/abort_request", json={"abort_all": True}, headers=bearer("gen"))
        assert resp.status_code == 401 and "admin api key" in resp.json()["message"]
        assert c.post("/abort_request", json={"abort_all": True}, headers=bearer("admin")).status_code == 200
        resp = c.post("/abort_request", json={"rid": "x"}, headers={**bearer("gen"), "Origin": "https://evil.example"})
        assert resp.status_code == 403  # a web page may not end the server's requests either
    with TestClient(create_app(eng, api_key="k")) as c:  # one key for everything: it may abort all
        assert c.post("/abort_request", json={"abort_all": True}, headers=bearer("k")).status_code == 200


def test_admin_key_alone_leaves_generation_open(engine_factory):
    eng = engine_factory()
    with TestClient(create_app(eng, admin_api_key="admin")) as c:
        assert c.post("/generate", json=GEN).status_code == 200
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers=bearer("admin")).status_code == 200


def test_api_key_alone_guards_everything_but_health(engine):
    with TestClient(create_app(engine, api_key="k")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/flush_cache").status_code == 401
        assert c.post("/flush_cache", headers=bearer("k")).status_code == 200
        assert c.get("/get_model_info").status_code == 401


@pytest.mark.parametrize("value", [
    "Bearer sécret".encode("utf-8"), b"Bearer \xff\xfe", b"\x00", b"Bearer " + b"k" * 10000, b"",
])
def test_hostile_authorization_headers_are_401(engine, value):
    with TestClient(create_app(engine, api_key="k", admin_api_key="a")) as c:
        for path in ("/generate", "/pause_generation"):
            resp = c.post(path, json=GEN, headers={"Authorization": value})
            assert resp.status_code == 401, (path, value)
        assert c.get("/health").status_code == 200


def test_two_authorization_headers_open_nothing(engine):
    """Which of two headers a proxy or framework reads differs: neither is taken (the wrong key
    first and the admin key second used to open /flush_cache)."""
    with TestClient(create_app(engine, api_key="k", admin_api_key="a")) as c:
        for pair in ([b"Bearer nope", b"Bearer a"], [b"Bearer a", b"Bearer nope"], [b"Bearer a", b"Bearer a"]):
            headers = [(b"authorization", v) for v in pair] + [(b"content-type", b"application/json")]
            resp = c.post("/flush_cache", content=b"{}", headers=headers)
            assert resp.status_code == 401, pair
        assert c.post("/flush_cache", headers=bearer("a")).status_code == 200
    with TestClient(create_app(engine, admin_api_key="a")) as c:  # /abort_request open, abort_all the admin's
        headers = [(b"authorization", b"Bearer a"), (b"authorization", b"junk"), (b"content-type", b"application/json")]
        resp = c.post("/abort_request", content=b'{"abort_all": true}', headers=headers)
        assert resp.status_code == 401 and "admin api key" in resp.json()["message"]


def test_keys_from_environment():
    env = {"TANDEM_API_KEY": "from-env", "TANDEM_ADMIN_API_KEY": "admin-env"}
    assert with_env_keys({"model_path": "m"}, env) == {"model_path": "m", "api_key": "from-env",
                                                      "admin_api_key": "admin-env"}
    assert with_env_keys({"api_key": "flag"}, env)["api_key"] == "flag"  # a flag wins
    assert with_env_keys({"api_key": None}, {}) == {"api_key": None}


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None, None) == ""
    assert exposure_warning("localhost", None, None) == ""
    loud = exposure_warning("0.0.0.0", None, None)
    assert "WITHOUT KEYS" in loud and "generation" in loud and "control" in loud
    assert "control" not in exposure_warning("0.0.0.0", None, "admin")
    assert exposure_warning("0.0.0.0", "k", "a") == ""
