"""The allowlist accepts the payloads torch and SGLang really build, and maps them onto tandem.

CUDA reductions cannot be made without a GPU, so these pickle the real reduction's structure
(torch.multiprocessing.reductions.rebuild_cuda_tensor by reference, the classes and values
reduce_tensor emits, fake handle bytes) and stop at torch's final rebuild, which is replaced by a
recorder: what the allowlist hands torch is asserted. SGLang's classes are pickled from modules
named exactly as SGLang's, so the bytes are what SGLang's MultiprocessingSerializer writes.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing.reductions as R

from weight_sync.bucket import FlattenedBucket
from weight_sync.cuda_ipc import RefusedPayload, deserialize, serialize

HANDLE, REF_HANDLE, EVENT = b"h" * 64, b"/torch_1_2_3", b"e" * 64


class _Call:
    def __init__(self, f, *args):
        self.f, self.args = f, args

    def __reduce__(self):
        return (self.f, self.args)


def _cuda_args(**change) -> tuple:
    """reduce_tensor's arguments for a CUDA float32 tensor of shape (4, 3) at offset 2 of a
    56-byte storage, in order."""
    args = dict(tensor_cls=torch.Tensor, tensor_size=torch.Size([4, 3]), tensor_stride=(3, 1), tensor_offset=2,
                storage_cls=torch.storage.TypedStorage, dtype=torch.float32, storage_device=0,
                storage_handle=HANDLE, storage_size_bytes=56, storage_offset_bytes=512, requires_grad=False,
                ref_counter_handle=REF_HANDLE, ref_counter_offset=7, event_handle=EVENT,
                event_sync_required=True)
    args.update(change)
    return tuple(args.values())


def _dumps(obj) -> bytes:
    return bytes(ForkingPickler.dumps(obj))


@pytest.fixture
def load(monkeypatch):
    """Pickles `obj`, then deserializes it with torch's CUDA rebuild replaced by a recorder that
    returns a CPU tensor of the asked size; the calls torch would have got are in load.calls."""
    calls = []

    def record(*args):
        calls.append(args)
        return torch.zeros(tuple(args[1]))

    def run(obj):
        data = obj if isinstance(obj, bytes) else _dumps(obj)
        with monkeypatch.context() as patched:
            patched.setattr(R, "rebuild_cuda_tensor", record)
            return deserialize(data)

    run.calls = calls
    return run


def test_torch_cuda_reduction_reaches_torch_with_the_real_classes(load):
    [(name, tensor)] = load([("w", _Call(R.rebuild_cuda_tensor, *_cuda_args()))])
    assert name == "w" and tensor.shape == (4, 3)
    (args,) = load.calls
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage  # tokens mapped back
    assert args[1:4] == ((4, 3), (3, 1), 2) and args[5] is torch.float32
    assert args[6:] == (0, HANDLE, 56, 512, False, REF_HANDLE, 7, EVENT, True)


def test_untyped_storage_class_and_parameters_are_accepted(load):
    load(_Call(R.rebuild_cuda_tensor, *_cuda_args(storage_cls=torch.UntypedStorage)))
    load(_Call(R.rebuild_cuda_tensor, *_cuda_args(tensor_cls=torch.nn.Parameter, event_handle=None,
                                                  event_sync_required=False)))
    assert load.calls[0][4] is torch.UntypedStorage
    assert load.calls[1][0] is torch.Tensor  # a Parameter arrives as a plain tensor


@pytest.mark.parametrize("change,reason", [
    ({"storage_cls": torch.FloatStorage}, "storage class is torch.FloatStorage; expected"),
    ({"storage_cls": torch.Tensor}, "storage class is torch.Tensor; expected"),
    ({"tensor_cls": torch.storage.TypedStorage}, "class is torch.storage.TypedStorage; expected torch.Tensor"),
    ({"storage_cls": "TypedStorage"}, "must be the class .*; got a str value"),
    ({"tensor_size": torch.Size([4, 4])}, "reaches past its storage of 14 elements"),
    ({"tensor_offset": 3}, "reaches past its storage"),
    ({"tensor_stride": (-3, 1)}, "negative"),
    ({"storage_device": -1}, "negative"),
    ({"storage_device": True}, "has type bool"),
    ({"ref_counter_offset": 10000}, "outside the ref-counter file"),
    ({"storage_handle": 1234}, "CUDA IPC handle has type int"),
    ({"dtype": "float32"}, "dtype has type str"),
])
def test_hostile_cuda_reductions_are_refused_by_name(load, change, reason):
    with pytest.raises(RefusedPayload, match=reason):
        load(_Call(R.rebuild_cuda_tensor, *_cuda_args(**change)))
    assert load.calls == []


@pytest.fixture
def sglang_modules(monkeypatch):
    """Modules named as SGLang's, holding classes named as SGLang's, so pickle writes SGLang's paths."""
    patch_torch = types.ModuleType("sglang.srt.utils.patch_torch")

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("never called on the engine side")

    _rebuild_cuda_tensor_modified.__module__ = patch_torch.__name__
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    patch_torch._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
    bucket_mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = bucket_mod.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    bucket_mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for mod in (patch_torch, bucket_mod):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return types.SimpleNamespace(rebuild=_rebuild_cuda_tensor_modified, Metadata=FlattenedTensorMetadata)


def _fake_gpus(monkeypatch, uuids: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


def test_sglang_cuda_rebuild_maps_the_gpu_uuid_to_the_local_index(sglang_modules, load, monkeypatch):
    _fake_gpus(monkeypatch, ["GPU-aaaa", "GPU-bbbb"])
    data = _dumps([("w", _Call(sglang_modules.rebuild, *_cuda_args(storage_device="GPU-bbbb")))])
    assert b"sglang.srt.utils.patch_torch" in data
    [(_, tensor)] = load(data)
    assert tensor.shape == (4, 3) and load.calls[0][6] == 1 and load.calls[0][4] is torch.storage.TypedStorage
    with pytest.raises(RefusedPayload, match="GPU 'GPU-cccc' is not visible to this engine"):
        load(_Call(sglang_modules.rebuild, *_cuda_args(storage_device="GPU-cccc")))
    with pytest.raises(RefusedPayload, match="takes 15 arguments"):
        load(_Call(sglang_modules.rebuild, *_cuda_args()[:14]))
    with pytest.raises(RefusedPayload, match="storage class is torch.FloatStorage"):
        load(_Call(sglang_modules.rebuild, *_cuda_args(storage_device="GPU-aaaa", storage_cls=torch.FloatStorage)))
    assert len(load.calls) == 1


def test_sglang_bucket_metadata_loads_as_a_tandem_bucket(sglang_modules):
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    ours = FlattenedBucket.pack(named)
    theirs = [sglang_modules.Metadata(**dataclasses.asdict(m)) for m in ours.metadata]
    data = _dumps({"flattened_tensor": ours.flattened_tensor, "metadata": theirs})
    assert b"sglang.srt.weight_sync.tensor_bucket" in data
    unpacked = FlattenedBucket.from_payload(deserialize(data)).unpack()
    assert [n for n, _ in unpacked] == ["a", "b"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, unpacked))


def test_other_sglang_classes_are_refused_by_name():
    data = b"\x80\x04csglang.srt.utils.patch_torch\nmonkey_patch_torch_reductions\n."
    with pytest.raises(RefusedPayload, match="names sglang.srt.utils.patch_torch.monkey_patch_torch_reductions"):
        deserialize(data)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_legacy_typed_storages_round_trip():
    storage = torch.arange(5, dtype=torch.float32).untyped_storage()
    back = deserialize(serialize(_Call(R.rebuild_typed_storage_child, storage, torch.FloatStorage)))
    assert back.dtype == torch.float32 and back.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    hostile = _Call(R.rebuild_typed_storage_child, torch.UntypedStorage(), torch.storage.TypedStorage)
    with pytest.raises(RefusedPayload, match="typed storage class is torch.storage.TypedStorage"):
        deserialize(serialize(hostile))
