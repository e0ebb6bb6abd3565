"""ServerProcess: a grammar process (engine/grammar/matcher_server.py, or a compile worker of
engine/grammar/compile_worker.py) as a child of this one.

It runs `python -m MODULE FD SETUP`, talking over one end of a socketpair
(a multiprocessing Connection: pickled messages, and the masks' memfd descriptors beside them).
Not multiprocessing's spawn: that re-imports the user's __main__ in the child, so a script that
builds an Engine without an `if __name__ == "__main__":` guard would build a second one there, on
the GPU. The child ends when its socket closes (the engine shut down, or its process died).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from multiprocessing import spawn
from multiprocessing.connection import Connection
from typing import Optional, Sequence


class ServerProcess:
    def __init__(self, module: str, setup: Sequence) -> None:
        """`setup`: the JSON-able arguments the module's main takes after its socket."""
        ours, theirs = socket.socketpair()
        setup = json.dumps(list(setup))
        paths = [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike)) and os.fspath(p)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the modules this process sees
        safe = ["-P"] if sys.version_info >= (3, 11) else []  # -P: no working directory put first on the path
        python = os.fsdecode(spawn.get_executable())  # sys.executable, or what multiprocessing.set_executable chose
        try:
            self._popen = subprocess.Popen(
                [python, *safe, "-m", module, str(theirs.fileno()), setup],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.poll()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
