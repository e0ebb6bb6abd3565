"""Hold: a callable's calls wait at their start until released, the window a test acts in (an
abort that arrives while a request is still being built)."""

from __future__ import annotations

import threading
from typing import Any, Callable


class Hold:
    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def around(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            self.started.set()
            assert self.release.wait(30)
            return original(*args, **kwargs)
        return held
