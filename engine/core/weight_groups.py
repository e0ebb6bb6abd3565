"""WeightGroups: this engine's broadcast groups, each formed on a thread of its own.

A rendezvous waits for the trainer (rank 0) to join, for up to `timeout_s`; on the core loop that
wait would stop generation. So `start` launches it on a thread and returns at once, generation goes
on, and `status` (polled by the front end) installs the group on the core thread once it formed,
or answers the failure, at the latest when the timeout has passed.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from engine.core.messages import InitWeightsGroupReq

Answer = tuple[bool, str]
FORMED = "Succeeded to initialize custom process group."


@dataclass
class _Forming:
    future: Future
    deadline: float  # time.monotonic() after which the caller is told it failed
    where: str


class WeightGroups:
    def __init__(self) -> None:
        self.formed: dict[str, Any] = {}  # group name -> weight_sync.weight_group.WeightGroup
        self._forming: dict[str, _Forming] = {}

    def start(self, msg: InitWeightsGroupReq) -> Optional[Answer]:
        """None: the rendezvous runs; else the refusal (a bad argument, a taken name)."""
        from weight_sync.weight_group import check_group_args

        name = msg.group_name
        if name in self.formed or name in self._forming:
            state = "already exists" if name in self.formed else "is still forming"
            return False, f"weight update group {name!r} {state}"
        try:
            check_group_args(msg.rank_offset, msg.world_size, msg.backend, msg.timeout_s, msg.master_port)
        except (ValueError, TypeError) as exc:
            return False, f"Failed to init weight update group {name!r}: {exc}"
        future: Future = Future()
        where = f"{msg.master_address}:{msg.master_port}"
        self._forming[name] = _Forming(future, time.monotonic() + msg.timeout_s, where)
        threading.Thread(target=_form, args=(msg, future), name=f"tandem-rendezvous-{name}", daemon=True).start()
        return None

    def status(self, name: str) -> Optional[Answer]:
        """None while forming; then the answer, once. A late group is dropped when it forms."""
        forming = self._forming.get(name)
        if forming is None:
            return (True, FORMED) if name in self.formed else (False, f"no weight update group {name!r} is forming")
        if not forming.future.done():
            if time.monotonic() < forming.deadline:
                return None
            self._abandon(name)
            return False, (f"Failed to init weight update group {name!r}: no rendezvous at {forming.where} within "
                           f"the timeout; is the trainer (rank 0) listening there?")
        del self._forming[name]
        exc = forming.future.exception()
        if exc is not None:
            return False, f"Failed to init weight update group {name!r}: {_first_line(exc)}"
        self.formed[name] = forming.future.result()
        return True, FORMED

    def destroy(self, name: str) -> Answer:
        if name in self._forming:
            self._abandon(name)
            return True, f"group {name!r} destroyed (its rendezvous was still running)"
        group = self.formed.pop(name, None)
        if group is None:
            return False, f"group {name!r} not found"
        group.destroy()
        return True, f"group {name!r} destroyed"

    def _abandon(self, name: str) -> None:
        self._forming.pop(name).future.add_done_callback(_destroy_result)


def _form(msg: InitWeightsGroupReq, future: Future) -> None:
    from weight_sync.weight_group import WeightGroup

    try:
        _resolve(msg.master_address, msg.master_port)
        group = WeightGroup(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name,
                            msg.backend, timeout_s=msg.timeout_s)
    except Exception as exc:  # a timeout, a refused connection, no NCCL: the caller reads it
        future.set_exception(exc)
    else:
        future.set_result(group)


def _resolve(address: str, port: int) -> None:
    """A master_address no lookup finds fails now, saying so (the rendezvous would only time out,
    blaming the trainer); on the rendezvous thread, never the core loop (a lookup can block)."""
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"master_address {address!r} does not resolve to an address ({exc}); "
                         "pass the trainer's host name or IP") from None


def _destroy_result(future: Future) -> None:
    if future.exception() is None:
        future.result().destroy()


def _first_line(exc: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else 'no detail'}"
