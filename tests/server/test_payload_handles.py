"""A weight payload whose handles never resolve blocks nobody (issue 27, item 3).

The payload names a shared-memory descriptor (torch's file_descriptor strategy: a DupFd) at a
multiprocessing listener that accepts and never answers. Fetching it used to run on the core's
step with no bound: the update hung and every /generate waited behind it. Now the core opens
payloads off its step (engine/core/payload_opener.py) and each descriptor fetch gives up after
weight_sync.shared_fd.FETCH_TIMEOUT_S: the update is a 400 naming the sender while generation goes on.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time

import pytest
import torch

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class _Call:
    def __init__(self, f, *args):
        self.f, self.args = f, args

    def __reduce__(self):
        return (self.f, self.args)


@pytest.fixture
def silent_listener():
    """A multiprocessing-style listener (a socket in a private pymp-* dir of the temp dir) that
    accepts connections and never answers: a hung or hostile sender."""
    folder = tempfile.mkdtemp(prefix="pymp-")
    address = os.path.join(folder, "listener-silent")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(8)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # held open, never written to
            except (socket.timeout, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield address
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


def hanging_payload(address: str) -> str:
    """[(name, tensor)] whose storage is a descriptor to fetch from `address`."""
    from multiprocessing.resource_sharer import DupFd

    import torch.multiprocessing.reductions as R

    handle = DupFd.__new__(DupFd)
    handle._id = (address, 1)
    storage = _Call(R.rebuild_storage_fd, torch.UntypedStorage, handle, 16)
    tensor = _Call(R.rebuild_tensor, torch.Tensor, _Call(R.rebuild_typed_storage, storage, torch.float32),
                   (0, (4,), (1,), False))
    return base64.b64encode(pickle.dumps([("model.norm.weight", tensor)])).decode()


@pytest.mark.parametrize("core_process", [False, True], ids=["thread_core", "process_core"])
def test_a_descriptor_that_never_arrives_is_a_400_while_generate_answers(engine_factory, live_server_factory,
                                                                         silent_listener, core_process):
    import httpx

    from weight_sync.shared_fd import FETCH_TIMEOUT_S

    eng = engine_factory(core_process=core_process)
    server = live_server_factory(eng)
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
    weights_before = eng.get_weights_by_name("model.norm.weight")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        expected = http.post("/generate", json=body).json()["output_ids"]
        reply: dict = {}

        def update() -> None:
            t0 = time.monotonic()
            resp = http.post("/update_weights_from_tensor",
                             json={"serialized_named_tensors": [hanging_payload(silent_listener)]})
            reply.update(status=resp.status_code, body=resp.json(), seconds=time.monotonic() - t0)

        updater = threading.Thread(target=update)
        updater.start()
        time.sleep(0.3)  # the update is pending: its descriptor fetch waits on the silent listener
        latencies = []
        while updater.is_alive():
            t0 = time.monotonic()
            out = http.post("/generate", json=body).json()
            latencies.append(time.monotonic() - t0)
            assert out["output_ids"] == expected
        updater.join()
    print(f"{'process' if core_process else 'thread'} core: blocking payload: {reply['status']} after {reply['seconds']:.2f} s; concurrent /generate "
          f"latency max {max(latencies):.3f} s, median {sorted(latencies)[len(latencies) // 2]:.3f} s "
          f"over {len(latencies)} requests")
    assert reply["status"] == 400 and not reply["body"]["success"]
    assert "did not answer within" in reply["body"]["message"] and silent_listener in reply["body"]["message"]
    assert FETCH_TIMEOUT_S - 0.5 <= reply["seconds"] <= FETCH_TIMEOUT_S + 5.0, reply["seconds"]
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    assert eng.get_weights_by_name("model.norm.weight") == weights_before
    eng.check_integrity()


def test_a_payload_that_cannot_be_opened_in_time_is_refused(engine_factory, monkeypatch):
    """Whatever a payload waits on (a handle no socket timeout can bound), the update is refused
    at the opener's deadline and the engine serves meanwhile and afterwards."""
    from engine.core import payload_opener
    from weight_sync.tensor import SerializedSource

    monkeypatch.setattr(payload_opener, "OPEN_TIMEOUT_S", 1.5)
    eng = engine_factory()
    release = threading.Event()

    class NeverOpens(SerializedSource):
        def open(self, tp_rank: int = 0):
            release.wait(60)
            raise ValueError("released")

    expected = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
    reply: list = []
    t0 = time.monotonic()
    updater = threading.Thread(target=lambda: reply.append(eng.update_weights(NeverOpens(b"x"))))
    updater.start()
    latencies = []
    while updater.is_alive():
        t1 = time.monotonic()
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"] == expected
        latencies.append(time.monotonic() - t1)
    elapsed = time.monotonic() - t0
    release.set()
    ok, message = reply[0]
    assert not ok and "could not be opened within 1.5 s" in message, message
    assert 1.4 <= elapsed <= 4.0, elapsed
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies
    ok, message = eng.update_weights_from_tensor(b"not a pickle")  # later payloads are answered as usual
    assert not ok and "could not be read" in message
