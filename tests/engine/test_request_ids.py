"""fresh_rid: uuid4().hex's shape, unique, from os.urandom in blocks (not a system call per id)."""

from __future__ import annotations

import uuid

from engine.api import request_ids


def test_ids_look_like_uuid4_hex_and_never_repeat(monkeypatch):
    calls = []
    real = request_ids.os.urandom
    monkeypatch.setattr(request_ids.os, "urandom", lambda n: calls.append(n) or real(n))
    ids = [request_ids.fresh_rid() for _ in range(1000)]
    assert len(set(ids)) == 1000
    for rid in ids:
        parsed = uuid.UUID(hex=rid)
        assert parsed.hex == rid and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert calls and set(calls) == {request_ids._POOL_BYTES}
    assert len(calls) <= 1000 * 16 // request_ids._POOL_BYTES + 1  # a block per 256 ids


def test_a_forked_child_draws_its_own_ids():
    import os

    request_ids.fresh_rid()  # a pool with ids left in it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, "".join(request_ids.fresh_rid() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    ours = "".join(request_ids.fresh_rid() for _ in range(4))
    assert len(child) == len(ours) == 128 and child != ours
