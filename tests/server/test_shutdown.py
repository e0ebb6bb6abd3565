"""`tandem serve` under SIGTERM: requests waiting (here behind a pause) get an answer and the
process exits within a few seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from engine.models.parallel_state import free_port


def start_serve(model_dir: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """`tandem serve` on a free port, once /health answers 200."""
    port = free_port()
    env = {**os.environ, "TANDEM_ADMIN_API_KEY": "admin"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.main", "serve", "--model-path", model_dir,
                             "--device", "cpu", "--dtype", "float32", "--port", str(port), *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("tandem serve did not come up")
        time.sleep(0.2)


def sigterm_then_join(proc: subprocess.Popen, waiter: threading.Thread, within_s: float) -> None:
    """SIGTERM the server: it exits within `within_s`, and the waiting client has its answer."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=within_s)
    assert time.monotonic() - start < within_s
    waiter.join(timeout=5)


def test_sigterm_with_waiting_requests_exits_fast(tiny_model_dir):
    proc, url = start_serve(tiny_model_dir)
    try:
        admin = {"Authorization": "Bearer admin"}
        assert httpx.post(f"{url}/pause_generation", json={"mode": "retract"}).status_code == 401  # env key
        assert httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, headers=admin).status_code == 200
        answers: list = []

        def waiting_client() -> None:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
            answers.append(httpx.post(f"{url}/generate", json=body, timeout=30))

        waiter = threading.Thread(target=waiting_client)
        waiter.start()
        time.sleep(0.5)  # the request is queued behind the pause
        sigterm_then_join(proc, waiter, within_s=10)
        assert len(answers) == 1
        finish = answers[0].json()["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and "shutting down" in finish["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_during_a_grammar_compile_answers_503(tiny_model_dir):
    """A request whose grammar is still compiling when SIGTERM comes gets a 503 naming the
    shutdown (issue 27: a bare 500), and the server exits within seconds."""
    import json

    proc, url = start_serve(tiny_model_dir, "--grammar-compile-timeout", "120")
    try:
        answers: list = []
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
        body = {"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}}
        waiter = threading.Thread(target=lambda: answers.append(httpx.post(f"{url}/generate", json=body, timeout=60)))
        waiter.start()
        time.sleep(3.0)  # the compile workers start, then the slow compile runs
        sigterm_then_join(proc, waiter, within_s=15)
        assert len(answers) == 1
        assert answers[0].status_code == 503, answers[0].text
        assert "shutting down" in answers[0].json()["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
