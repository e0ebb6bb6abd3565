"""The shared-memory descriptor a payload may name: multiprocessing's DupFd (torch's default
file_descriptor sharing strategy for CPU tensors), fetched with a bounded wait.

A payload can only describe one, never create one (creating one registers a descriptor of this
process for sharing). Its detach() fetches the descriptor only from a multiprocessing listener of
this user (weight_sync.rebuilds.is_mp_listener), over a socket whose connect and every send and
receive give up after FETCH_TIMEOUT_S: a listener that accepts and never answers (a hung, dead or
hostile sender) makes the payload a refusal in seconds, never a wait without end. The exchange is
multiprocessing's own (resource_sharer.get_connection): the authkey challenge both ways, then
(key, pid), then the descriptor over SCM_RIGHTS.
"""

from __future__ import annotations

import os
import socket
import struct

from weight_sync.rebuilds import is_mp_listener, refuse

FETCH_TIMEOUT_S = 5.0  # each step of fetching one descriptor from its sender's socket


def dup_fd_class() -> type:
    """A fresh DupFd subclass (one per payload: a BUILD aimed at it changes only that payload's)."""
    from multiprocessing.resource_sharer import DupFd

    def new(cls, *args):
        if args:
            raise refuse("a payload may not create a shared-memory descriptor")
        return object.__new__(cls)

    def init(self, *args):
        raise refuse("a payload may not create a shared-memory descriptor")

    def detach(self) -> int:
        ident = getattr(self, "_id", None)
        address = ident[0] if isinstance(ident, tuple) and len(ident) == 2 else None
        if not (isinstance(address, str) and isinstance(ident[1], int) and is_mp_listener(address)):
            raise refuse(f"a shared-memory descriptor points at {address!r}, not a local multiprocessing listener")
        return fetch_fd(address, ident[1], FETCH_TIMEOUT_S)

    return type("DupFd", (DupFd,), {"__new__": new, "__init__": init, "detach": detach, "_tandem_checked": True})


def fetch_fd(address: str, key: int, timeout: float) -> int:
    """The descriptor registered under `key` at the resource sharer listening on `address`."""
    from multiprocessing import AuthenticationError, connection, process, reduction

    try:
        conn = _connect(address, timeout)
    except OSError as exc:
        raise refuse(f"the sender's descriptor socket {address} cannot be reached ({exc})") from exc
    try:
        with conn:
            authkey = process.current_process().authkey
            connection.answer_challenge(conn, authkey)
            connection.deliver_challenge(conn, authkey)
            conn.send((key, os.getpid()))
            return reduction.recv_handle(conn)
    except AuthenticationError as exc:
        raise refuse("a CPU tensor was sent as a file descriptor, which only a process sharing the "
                     "sender's multiprocessing authkey may fetch; serialize with "
                     "weight_sync.cuda_ipc.serialize (named shared memory) or "
                     "torch.multiprocessing.set_sharing_strategy('file_system')") from exc
    except (BlockingIOError, TimeoutError) as exc:
        raise refuse(f"the sender of a shared-memory descriptor ({address}) did not answer within "
                     f"{timeout:g} s") from exc
    except (OSError, EOFError) as exc:
        raise refuse(f"the sender of a shared-memory descriptor ({address}) failed: {type(exc).__name__}: "
                     f"{exc}") from exc


def _connect(address: str, timeout: float):
    """A multiprocessing Connection whose reads and writes time out in the kernel (SO_RCVTIMEO /
    SO_SNDTIMEO: the Connection reads the raw descriptor, so a Python socket timeout would not hold)."""
    from multiprocessing import connection

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.setblocking(True)
        limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        return connection.Connection(sock.detach())
    finally:
        sock.close()  # a no-op once detached
