"""Ctrl-C and SIGTERM during `tandem train`: stop promptly, shut the engines and Ray down, say so.

Python turns SIGINT into KeyboardInterrupt but lets SIGTERM kill the process at once (after
ray.init, Ray's own handler dumps a stack and aborts), leaving Ray's raylet and engine actors
behind. Inside `signals_stop_the_run` both signals raise `Interrupted` in the main thread, so the
run's with/finally blocks close the engines and Ray on one path; a second signal while that runs
is reported and waited out, a third exits at once. `RunInterrupted` is a SystemExit (130 or 143,
the shell's codes), so the CLI ends without a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunInterrupted(SystemExit):
    """The run stopped on a signal after cleaning up; code 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Stop:
    """What signals_stop_the_run saw: the first signal's number (None: none came). Kept here, as
    Ray's ray.get turns a handler's exception into a plain KeyboardInterrupt (SIGTERM read as SIGINT)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.count = 0


@contextmanager
def signals_stop_the_run() -> Iterator[Stop]:
    """SIGINT and SIGTERM raise Interrupted here (main thread only; elsewhere a no-op)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        stop.count += 1
        if stop.count == 1:
            stop.signum = signum
            raise Interrupted(signum)
        if stop.count == 2:
            print(f"tandem train: {signal.Signals(signum).name} again: still shutting the engines down "
                  f"(once more to quit now, leaving them running)", file=sys.stderr, flush=True)
            return
        os._exit(128 + signum)

    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
