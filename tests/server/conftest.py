"""Fixtures for the server tests: the tiny model, engines over it, an app under TestClient and a
real uvicorn server on a free port (for disconnects, which TestClient cannot make)."""

from __future__ import annotations

import gc
import socket
import threading
import time

import pytest

pytest.importorskip("httpx")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """Same architecture and tokenizer, other weights: a weight update's source."""
    from engine.testing.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-b"), preset="tiny", seed=1))


@pytest.fixture(scope="module")
def engine_factory(tiny_model_dir):
    """Engines of one module, shut down when it ends (each holds ~160 MB on the CPU: KV pool and
    req_to_token table; a session of them grew the suite's process by GBs)."""
    from engine import Engine

    engines = []

    def make(**kwargs):
        eng = Engine(model_path=tiny_model_dir, **{"dtype": "float32", "device": "cpu", **kwargs})
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()
    engines.clear()
    gc.collect()  # an EngineCore is a reference cycle: free its tensors now, not at some later collection


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    from engine import Engine

    eng = Engine(model_path=tiny_model_dir, dtype="float32", device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def raw(engine):
    """Under TestClient that answers a 500 rather than raising it, so a test sees what a client
    sees; `raw.post_bytes(path, body)` posts a body as given (JSON escapes, non-finite literals)."""
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        c.post_bytes = lambda path, body: c.post(path, content=body, headers={"content-type": "application/json"})
        yield c


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from engine.server.http import create_app

    with TestClient(create_app(engine)) as c:
        yield c


class LiveServer:
    """create_app(engine) under uvicorn on a thread, on a free local port."""

    def __init__(self, engine, **app_kwargs) -> None:
        import uvicorn

        from engine.server.http import create_app

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, **app_kwargs), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def live_server_factory():
    servers = []

    def make(engine, **app_kwargs) -> LiveServer:
        server = LiveServer(engine, **app_kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
