"""Tensors between processes by reference: CUDA IPC handles on the GPU, shared memory on the CPU.

`serialize` pickles with torch's multiprocessing reductions (what SGLang's
MultiprocessingSerializer does): a CUDA tensor becomes an IPC handle into the sender's memory (no
copy), a CPU tensor a named shared-memory file (torch's file_system sharing strategy, chosen for
this pickler only: a passed descriptor, torch's default, can be fetched only by a process that
shares the sender's multiprocessing authkey, so an unrelated engine process would be refused).
Both accept base64 text, the form the HTTP route carries.

Memory: send one flattened bucket (weight_sync.bucket) per payload, so one IPC handle maps one
allocation. The sender keeps its buffers alive until the engine's update returns; a sender that
reuses the same bucket buffers for every update (and calls torch.cuda.ipc_collect() after each)
keeps GPU memory flat, since the engine's mapping of a handle is closed when its tensors die.

`deserialize` never runs plain `pickle.loads`. A payload may name only the globals those
reductions emit, plus SGLang's bucket metadata class, its UUID-keyed CUDA rebuild and its per-rank
LocalSerializedTensor (weight_sync.local_tensor; whose values may hold tensor reductions only):
anything else, e.g. os.system, builtins.eval, torch.hub.load, is refused by name. Even those are not
handed out as they are: each payload gets its own checked stand-ins (weight_sync.rebuilds). The
rebuild functions become wrappers that check every argument before calling torch's; the classes
they take become inert tokens mapped back to the real class; DupFd (weight_sync.shared_fd: described,
never created, fetched with a bounded wait), the bucket metadata and LocalSerializedTensor become
fresh subclasses. So a BUILD opcode aimed at
a class or function changes only that payload's stand-in, never the process.
"""

from __future__ import annotations

import base64
import collections
import io
import pickle
from typing import Any, Union

import torch

from weight_sync.local_tensor import SGLANG_CLASSES as _LOCAL_TENSOR
from weight_sync.rebuilds import LEGACY_STORAGES, RefusedPayload, Token, checked_rebuild, refuse

__all__ = ["ALLOWED_GLOBALS", "RefusedPayload", "deserialize", "serialize"]

_IMMUTABLE = {("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
              ("collections", "OrderedDict"): collections.OrderedDict}
_TOKENS = {("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
           ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
           ("torch.storage", "TypedStorage"): torch.TypedStorage,
           **{(c.__module__, c.__name__): c for c in LEGACY_STORAGES}}
_DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
_TORCH_REBUILDS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
                   "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")
# SGLang's payload classes (sglang.srt.utils.patch_torch; sglang.srt.patch_torch before 0.5)
_SGLANG_CUDA_REBUILD = {("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
                        ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified")}
_METADATA = {("weight_sync.bucket", "FlattenedTensorMetadata"),
             ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")}
_DUP_FD = ("multiprocessing.resource_sharer", "DupFd")
TENSOR_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    set(_IMMUTABLE) | set(_TOKENS) | {("torch", name) for name in _DTYPES}
    | {("torch.multiprocessing.reductions", name) for name in _TORCH_REBUILDS} | _SGLANG_CUDA_REBUILD | {_DUP_FD})
# a whole payload may also hold bucket metadata and SGLang's per-rank LocalSerializedTensor
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = TENSOR_GLOBALS | _METADATA | _LOCAL_TENSOR


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[tuple[str, str]] = ALLOWED_GLOBALS) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._allowed:
            what = ("weight payloads may hold only tensors, names and bucket metadata" if self._allowed is
                    ALLOWED_GLOBALS else "a LocalSerializedTensor's value may hold only a tensor")
            raise refuse(f"it names {module}.{name}, which is not a tensor reduction ({what})")
        if key not in self._stand_ins:
            self._stand_ins[key] = self._stand_in(key)
        return self._stand_ins[key]

    def _stand_in(self, key: tuple[str, str]) -> Any:
        module, name = key
        if key in _IMMUTABLE:
            return _IMMUTABLE[key]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if key in _TOKENS:
            return Token(_TOKENS[key])
        if module == "torch.multiprocessing.reductions" or key in _SGLANG_CUDA_REBUILD:
            return checked_rebuild(name)
        if key == _DUP_FD:
            from weight_sync.shared_fd import dup_fd_class

            return dup_fd_class()
        if key in _LOCAL_TENSOR:
            from weight_sync.local_tensor import RankValues

            return type("LocalSerializedTensor", (RankValues,), {})
        from weight_sync.bucket import FlattenedTensorMetadata  # tandem's or SGLang's: same fields

        return type("FlattenedTensorMetadata", (FlattenedTensorMetadata,), {})


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple:
    """torch's file_system-strategy reduction of a CPU storage, for this pickler only: a named
    shared-memory file that any process of this user can open, no authkey involved. The incref
    keeps the file alive for the receiver, which drops that reference once it has mapped it."""
    from torch.multiprocessing import reductions as R

    if storage.device.type != "cpu":
        return R.reduce_storage(storage)  # torch's error for CUDA and meta storages
    if storage.size() == 0:
        return (R.rebuild_storage_empty, (type(storage),))
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()
    R.shared_cache[handle] = R.StorageWeakRef(storage)
    return (R.rebuild_storage_filename, (type(storage), manager, handle, size))


def serialize(obj: Any, as_text: bool = False) -> Union[bytes, str]:
    """Pickle `obj` (e.g. [(name, tensor)] or a bucket payload) with tensors by reference."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor and storage reductions)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name
    pickler.dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if as_text else data


def deserialize(data: Union[bytes, str], tensors_only: bool = False) -> Any:
    """The object `serialize` (or SGLang's MultiprocessingSerializer) wrote, through the
    allowlist; base64 text is decoded first. tensors_only: tensor reductions alone (a
    LocalSerializedTensor's value), no bucket metadata or nesting."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise refuse(f"not base64 ({exc})") from exc
    try:
        return _AllowlistUnpickler(data, TENSOR_GLOBALS if tensors_only else ALLOWED_GLOBALS).load()
    except RefusedPayload:
        raise
    except Exception as exc:  # truncated or corrupt pickle, dead sender, bad IPC handle, wrong arity
        raise refuse(f"it could not be read: {type(exc).__name__}: {exc}") from exc


# what a hostile or broken payload can raise while it is decoded: the sender's fault, refused
PAYLOAD_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, EOFError,
                  pickle.UnpicklingError)
