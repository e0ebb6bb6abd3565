"""CPU tensors by reference from an unrelated process (issue 14 item 8), and hostile variants.

The trainer here is a separate interpreter (its own multiprocessing authkey, as a trainer started
by Ray or by hand has): the fd-passing form torch uses by default cannot be fetched from it, the
named shared-memory form `serialize` writes can. Oracle: an engine started on the pushed weights.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing.reductions as R

from weight_sync.cuda_ipc import RefusedPayload, deserialize

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 40, 41, 42]]
TRAINER = """
import sys, torch
from safetensors.torch import load_file
from engine.models.loader import safetensors_files
from weight_sync.bucket import FlattenedBucket
from weight_sync.cuda_ipc import serialize
named = [(n, t) for p in safetensors_files(sys.argv[1]) for n, t in load_file(p).items()]
payload = FlattenedBucket.pack(named).to_payload()
if sys.argv[2] == "torch-default":  # what a plain ForkingPickler with torch's fd strategy writes
    import base64, torch.multiprocessing
    from multiprocessing.reduction import ForkingPickler
    print(base64.b64encode(bytes(ForkingPickler.dumps(payload))).decode(), flush=True)
else:
    print(serialize(payload, as_text=True), flush=True)
sys.stdin.readline()  # keep the tensors alive until the engine has loaded them
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    from engine.testing.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("shm")
    return (str(build_tiny_model(root / "a", preset="tiny", seed=0)),
            str(build_tiny_model(root / "b", preset="tiny", seed=1)))


def _ids(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _trainer(checkpoint: str, form: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, checkpoint, form], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_a_bucket_from_an_unrelated_process_loads_and_the_fd_form_is_refused(checkpoints):
    from engine import Engine

    expected_eng = Engine(model_path=checkpoints[1], dtype="float32", device="cpu")
    expected = _ids(expected_eng)
    expected_eng.shutdown()
    eng = Engine(model_path=checkpoints[0], dtype="float32", device="cpu")
    trainers = [_trainer(checkpoints[1], "torch-default"), _trainer(checkpoints[1], "tandem")]
    try:
        before = _ids(eng)
        with pytest.raises(RefusedPayload, match="only a process sharing the sender's multiprocessing authkey"):
            deserialize(trainers[0].stdout.readline().strip())
        assert _ids(eng) == before  # refused before anything was touched
        payload = deserialize(trainers[1].stdout.readline().strip())
        ok, message = eng.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="shm-1")
        assert ok, message
        del payload
        assert _ids(eng) == expected != before
        assert eng.get_weight_version() == "shm-1"
        eng.check_integrity()
    finally:
        for trainer in trainers:
            trainer.communicate("done\n", timeout=60)
        eng.shutdown()
    assert [t.returncode for t in trainers] == [0, 0]


class _Call:
    def __init__(self, f, *args):
        self.f, self.args = f, args

    def __reduce__(self):
        return (self.f, self.args)


def _shared() -> tuple[bytes, bytes, int]:
    storage = torch.arange(8, dtype=torch.float32).untyped_storage()
    storage._share_filename_cpu_()
    _shared.keep = storage  # alive for the test
    return storage._share_filename_cpu_()


def _load(manager, handle, size) -> None:
    import pickle

    deserialize(pickle.dumps(_Call(R.rebuild_storage_filename, torch.UntypedStorage, manager, handle, size)))


def test_named_shared_memory_is_checked_before_it_is_opened(tmp_path):
    manager, handle, size = _shared()
    path = b"/dev/shm" + handle
    file_size = os.path.getsize(path)
    with pytest.raises(RefusedPayload, match="reaches past shared-memory file"):
        _load(manager, handle, size + 1)  # torch would grow the file to fit
    assert os.path.getsize(path) == file_size
    with pytest.raises(RefusedPayload, match="is not one torch makes"):
        _load(manager, b"/../../etc/passwd", 4)
    with pytest.raises(RefusedPayload, match="cannot be opened"):
        _load(manager, b"/torch_1_2_999999", 4)
    planted_dir = tmp_path / "torch-shm-dir-x"
    planted_dir.mkdir(mode=0o755)
    planted = socket.socket(socket.AF_UNIX)
    planted.bind(str(planted_dir / "manager.sock"))
    try:
        for bad in (str(planted_dir / "manager.sock").encode(), b"/var/run/docker.sock", manager + b"x"):
            with pytest.raises(RefusedPayload, match="not a torch_shm_manager socket of this user"):
                _load(bad, handle, size)
    finally:
        planted.close()
    with pytest.raises(RefusedPayload, match="shared-memory name has type str"):
        _load(manager, handle.decode(), size)
    _load(manager, handle, size)  # the real one still loads
