"""EarlyAborts: aborts that arrive while a request is still being built.

A request is tokenized, its chat template rendered and its grammar checked before its rid is
registered and sent to the core (a big JSON schema takes up to --grammar-compile-timeout). An
abort in that window reaches the core first, which drops rids it does not know, and the request
would then run to its end: slime's `abort_all` at the end of a rollout, a client's
/abort_request. So every abort is remembered with a sequence number; a request built since an
earlier number is aborted again, by its own rid, right after it is sent, when one of the aborts
since then names it. Only its own rid: repeating an `abort_all` would also end requests sent
after that abort. (As in SGLang, whose rid is registered before it is tokenized, an update's
`abort_all_requests` ends such a request too.)
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Optional

KEEP = 4096  # aborts by rid remembered: far more than arrive while one request is built
MAX_RID_CHARS = 1024  # longer rids are not remembered (4096 of them would pin gigabytes)
# how an abort names requests (engine/core/intake.py): the rid alone (it is in flight), the rid
# or what it was expanded into (rid-0.. for n samples, rid_0.. for a batch), every rid it begins
EXACT, NAMED, PREFIX = "exact", "named", "prefix"


class EarlyAborts:
    def __init__(self, keep: int = KEEP) -> None:
        self._seq = 0
        self._last_all = 0  # the newest abort_all's number: never forgotten
        self._recent: deque[tuple[int, str, str]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def mark(self) -> int:
        """Taken when a request's build begins: aborts after it may name the request."""
        with self._lock:
            return self._seq

    def record(self, rid: Optional[str], how: str = NAMED) -> None:
        """An abort of everything (rid None) or of `rid`, matched `how`."""
        with self._lock:
            self._seq += 1
            if rid is None:
                self._last_all = self._seq
            elif len(rid) <= MAX_RID_CHARS:
                self._recent.append((self._seq, rid, how))

    def named(self, rids: Iterable[str], since: int) -> list[str]:
        """Those of `rids` that an abort recorded after `since` names."""
        rids = list(rids)
        with self._lock:
            if self._seq == since:  # the usual case: no abort since, nothing to walk
                return []
            if self._last_all > since:
                return rids
            exact: set[str] = set()
            named: set[str] = set()
            prefixes: list[str] = []
            for seq, rid, how in reversed(self._recent):  # newest first: stop at the mark
                if seq <= since:
                    break
                if how == PREFIX:
                    prefixes.append(rid)
                else:
                    (exact if how == EXACT else named).add(rid)
        return [rid for rid in rids if rid in exact or rid in named or _expanded_from(rid, named)
                or any(rid.startswith(p) for p in prefixes)]


def _expanded_from(rid: str, named: set[str]) -> bool:
    """Whether `rid` is a sample or a batch entry (base-i, base_i) of a named rid."""
    for sep in "-_":
        base, found, _ = rid.rpartition(sep)
        while found:
            if base in named:
                return True
            base, found, _ = base.rpartition(sep)
    return False
