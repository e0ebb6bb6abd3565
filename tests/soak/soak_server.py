"""The server under soak: `tandem serve` as a subprocess on the tiny model (CPU), with an admin
key, its log in a file; its resident memory read from /proc (the process and its children, so a
core process would count too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.models.parallel_state import free_port

ADMIN_KEY = "soak-admin"


def build_checkpoints(root: Path) -> tuple[str, str]:
    """Two tiny checkpoints, same architecture and tokenizer, other weights: A is served first,
    weight updates alternate between them."""
    from engine.testing.tiny_model import build_tiny_model

    return (str(build_tiny_model(root / "ckpt-a", preset="tiny", seed=0)),
            str(build_tiny_model(root / "ckpt-b", preset="tiny", seed=1)))


class ServeProcess:
    def __init__(self, model_path: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "tandem.main", "serve", "--model-path", model_path, "--device", "cpu",
               "--dtype", "float32", "--port", str(self.port), "--admin-api-key", ADMIN_KEY]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=environ_without_keys())

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode} (see its log)"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tandem serve did not come up"
            time.sleep(0.3)

    def rss_mb(self) -> float:
        """Resident memory of the server and its descendants, MiB."""
        return sum(_rss_kb(pid) for pid in _tree(self.proc.pid)) / 1024

    def stop(self, timeout: float = 10.0) -> tuple[int, float]:
        """SIGTERM, then wait: (exit code, seconds to exit); killed if it overstays."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode, time.monotonic() - start


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return pids


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:  # gone meanwhile
        pass
    return 0


def environ_without_keys() -> dict[str, str]:
    """The server takes its keys from the flags only."""
    return {k: v for k, v in os.environ.items() if k not in ("TANDEM_API_KEY", "TANDEM_ADMIN_API_KEY")}
