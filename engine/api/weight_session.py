"""WeightUpdateSession: SGLang 0.5.23's begin_weight_update / end_weight_update pairing.

Miles opens a session around every sync (begin, the updates, end). tandem loads weights as they
come, so a session only checks the order: a second begin, or an end with none open, is refused
with SGLang's messages (its SchedulerWeightUpdaterManager), so a trainer whose pairing broke finds
out; updates outside a session still work (slime never opens one). One session per Engine, shared
by its HTTP routes and its in-process calls.
"""

from __future__ import annotations

import threading
from typing import Optional

WEIGHT_SELECTORS = ("target", "draft", "all")


class WeightUpdateSession:
    def __init__(self) -> None:
        self.selector: Optional[str] = None
        self._lock = threading.Lock()

    def begin(self, selector: str = "all") -> tuple[bool, str]:
        if selector not in WEIGHT_SELECTORS:
            return False, f"selector must be one of {', '.join(WEIGHT_SELECTORS)}; got {selector!r}"
        with self._lock:
            if self.selector is not None:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.selector = selector
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        with self._lock:
            if self.selector is None:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.selector = None
        return True, "Success"
