"""PayloadOpener: weight payloads that must be fetched from their sender are opened off the step.

A serialized update (weight_sync.tensor.SerializedSource) names tensors another process holds:
CUDA IPC handles, shared-memory files, or descriptors fetched over the sender's socket. Fetching
waits on that process, and a hung, dead or hostile one may never answer; on the core's step that
wait would stall every request. So the worker (engine/core/worker.py) hands such an update here:
a thread of the core's process opens it while the core keeps stepping, and the opened update
comes back to be loaded between two steps like any other. One not opened within OPEN_TIMEOUT_S is
refused (that call's (False, reason)); its thread is left behind (descriptor fetches give up on
their own, weight_sync.shared_fd), and at most MAX_OPENING are ever in flight, left ones included.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.core.messages import LoadLoraReq, UpdateWeightsReq

logger = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 10.0  # opening one payload (its descriptor fetches give up after 5 s each)
MAX_OPENING = 8  # payloads being opened at once, those past their time included


@dataclass
class _Opening:
    msg: UpdateWeightsReq
    call_id: Optional[int]
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    opened: Any = None
    error: Optional[BaseException] = None


class PayloadOpener:
    def __init__(self, timeout_s: Optional[float] = None) -> None:
        self.timeout_s = OPEN_TIMEOUT_S if timeout_s is None else timeout_s
        self._opening: list[_Opening] = []
        self._left: list[_Opening] = []  # past their time, thread still running
        self._wake = threading.Event()

    @staticmethod
    def wants(msg: Any) -> bool:
        """A weight update or a LoRA load whose source is still serialized."""
        return isinstance(msg, (UpdateWeightsReq, LoadLoraReq)) and callable(getattr(msg.source, "open", None))

    @property
    def pending(self) -> bool:
        return bool(self._opening)

    def start(self, msg: UpdateWeightsReq, call_id: Optional[int]) -> Optional[str]:
        """Start opening msg's source; or why not (too many in flight)."""
        self._left = [o for o in self._left if not o.done.is_set()]
        busy = len(self._opening) + len(self._left)
        if busy >= MAX_OPENING:
            return (f"payload refused: {busy} weight payloads are still being opened (their senders do not "
                    f"answer); at most {MAX_OPENING} at once")
        opening = _Opening(msg, call_id, time.monotonic() + self.timeout_s)
        self._opening.append(opening)
        threading.Thread(target=self._open, args=(opening,), name="tandem-payload-open", daemon=True).start()
        return None

    def _open(self, opening: _Opening) -> None:
        try:
            opening.opened = opening.msg.source.open()
        except BaseException as exc:  # reported to the caller; the thread ends
            opening.error = exc
        opening.done.set()
        self._wake.set()

    def finished(self) -> list[tuple[Optional[UpdateWeightsReq], Optional[int], Optional[str]]]:
        """(update with its source opened, call id, None) or (None, call id, refusal) for each
        opening that ended or ran out of time."""
        if not self._opening:  # the loop asks between every two steps
            return []
        now, out, still = time.monotonic(), [], []
        for o in self._opening:
            if o.done.is_set():
                ok = o.error is None
                out.append((dataclasses.replace(o.msg, source=o.opened) if ok else None, o.call_id,
                            None if ok else _refusal(o.error)))
            elif now >= o.deadline:
                logger.warning("a weight payload was not opened within %.1f s; refused", self.timeout_s)
                self._left.append(o)
                out.append((None, o.call_id, f"payload refused: its tensors could not be opened within "
                                             f"{self.timeout_s:g} s (the sender does not answer)"))
            else:
                still.append(o)
        self._opening = still
        return out

    def wait(self, timeout: float) -> None:
        """Until an opening ends (or `timeout`): the worker's wait when nothing else is to do."""
        self._wake.wait(timeout)
        self._wake.clear()


def _refusal(exc: BaseException) -> str:
    if isinstance(exc, ValueError):
        return str(exc)
    logger.error("opening a weight payload failed", exc_info=exc)
    return f"payload refused: {type(exc).__name__}: {exc}"
