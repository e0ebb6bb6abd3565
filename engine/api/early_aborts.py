"""EarlyAborts: aborts that arrive while a request is still being built.

A request is tokenized, its chat template rendered and its grammar checked before its rid is
registered and sent to the core (a big JSON schema takes up to --grammar-compile-timeout). An
abort in that window reaches the core first, which drops rids it does not know, and the request
would then run to its end: slime's `abort_all` at the end of a rollout, a client's
/abort_request. So every abort is remembered with a sequence number; a request built since an
earlier number is aborted again, by its own rid, right after it is sent, when one of the aborts
since then names it. Only its own rid: repeating an `abort_all` would also end requests sent
after that abort.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Optional

KEEP = 4096  # aborts remembered: far more than arrive while one request is built


class EarlyAborts:
    def __init__(self, keep: int = KEEP) -> None:
        self._seq = 0
        self._recent: deque[tuple[int, Optional[str], bool]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def mark(self) -> int:
        """Taken when a request's build begins: aborts after it may name the request."""
        with self._lock:
            return self._seq

    def record(self, rid: Optional[str], prefix: bool = False) -> None:
        """An abort of `rid` (every rid starting with it when `prefix`), or of everything (None)."""
        with self._lock:
            self._seq += 1
            self._recent.append((self._seq, rid, prefix))

    def named(self, rids: Iterable[str], since: int) -> list[str]:
        """Those of `rids` that an abort recorded after `since` names."""
        with self._lock:
            if self._seq == since:  # the usual case: no abort since, nothing to walk
                return []
            aborts = []
            for seq, rid, prefix in reversed(self._recent):  # newest first: stop at the mark
                if seq <= since:
                    break
                aborts.append((rid, prefix))
        return [rid for rid in rids if any(_names(target, prefix, rid) for target, prefix in aborts)]


def _names(target: Optional[str], prefix: bool, rid: str) -> bool:
    """As the core matches an abort (engine/core/intake.py): everything, a prefix, or the rid and
    the requests it was expanded into (rid-0.. for n samples, rid_0.. for a batch's prompts)."""
    if target is None:
        return True
    if prefix:
        return rid.startswith(target)
    return rid == target or rid.startswith((target + "-", target + "_"))
