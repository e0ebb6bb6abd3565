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
