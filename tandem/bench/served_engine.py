"""`tandem bench --serve`: a `tandem serve` subprocess with the bench's engine settings, for the
HTTP half of the comparison. Its log goes to a file, whose tail is shown if it fails to start.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

logger = logging.getLogger("tandem")
STARTUP_TIMEOUT_S = 1800.0  # model load + CUDA graph capture of a large model
STOP_TIMEOUT_S = 60.0


class ServedEngine:
    def __init__(self, engine_kwargs: dict[str, Any], extra_args: list[str], host: str = "127.0.0.1") -> None:
        from tandem.server_args import server_args_to_argv

        settings = {k: v for k, v in engine_kwargs.items() if k not in ("host", "port")}
        self.port = _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.argv = [sys.executable, "-m", "tandem.main", "serve", *server_args_to_argv(settings),
                     "--host", host, "--port", str(self.port), *extra_args]
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="tandem-bench-serve-"), "serve.log")
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    def __enter__(self) -> "ServedEngine":
        logger.info("starting %s (log: %s)", " ".join(self.argv[1:]), self.log_path)
        started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: Any) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)  # uvicorn stops, then the engine shuts down
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("tandem serve did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"tandem bench: `tandem serve` exited with code {self.proc.returncode} "
                                 f"during start-up; the end of its log ({self.log_path}):\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"tandem bench: `tandem serve` was not healthy after {STARTUP_TIMEOUT_S:.0f} s; "
                         f"its log: {self.log_path}")

    def _log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
