"""`tandem serve` under SIGTERM: requests waiting (here behind a pause) get an answer and the
process exits within a few seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_with_waiting_requests_exits_fast(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "TANDEM_ADMIN_API_KEY": "admin"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.main", "serve", "--model-path", tiny_model_dir,
                             "--device", "cpu", "--dtype", "float32", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tandem serve did not come up"
            time.sleep(0.2)
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
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - start < 10
        waiter.join(timeout=5)
        assert len(answers) == 1
        finish = answers[0].json()["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and "shutting down" in finish["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
