"""Tensors between processes by reference: CUDA IPC handles on the GPU, shared memory on the CPU.

`serialize` pickles with torch's multiprocessing reductions (what SGLang's
MultiprocessingSerializer does): a CUDA tensor becomes an IPC handle into the sender's memory (no
copy), a CPU tensor a shared-memory file descriptor. The sender keeps the tensors alive until the
receiver has loaded them. Both accept base64 text, the form the HTTP route carries.

`deserialize` never runs plain `pickle.loads`. A payload may name only the globals those
reductions emit (anything else, e.g. os.system, builtins.eval, torch.hub.load, is refused by
name), and even those are not handed out as they are: each payload gets its own checked stand-ins.
The rebuild functions become wrappers that check every argument's type before calling torch's
(a tensor posing as a file descriptor, a view past its storage, an fd fetched from anywhere but
a sender's multiprocessing listener of this user: refused); the classes they take (torch.Tensor,
storages) become inert tokens; DupFd (which a payload may describe but not create) and the bucket
metadata class become fresh subclasses. So a BUILD opcode aimed at a class or function
changes only that payload's stand-in, never the process.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import tempfile
from typing import Any, Callable, Union

import torch

_IMMUTABLE = {("torch", "Size"): torch.Size, ("torch", "device"): torch.device}
_TOKENS = {("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.Tensor,
           ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
           ("torch.storage", "TypedStorage"): torch.TypedStorage}
_DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
_CUDA_REF_COUNTER_SLOTS = 10000  # torch's CUDA IPC ref-counter file (CUDA_IPC_REF_COUNTER_FILE_SIZE)
_REBUILDS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_empty",
             "rebuild_typed_storage", "rebuild_typed_storage_child")
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    set(_IMMUTABLE) | set(_TOKENS) | {("torch", name) for name in _DTYPES}
    | {("torch.multiprocessing.reductions", name) for name in _REBUILDS}
    | {("multiprocessing.resource_sharer", "DupFd"), ("collections", "OrderedDict"),
       ("weight_sync.bucket", "FlattenedTensorMetadata")})


class RefusedPayload(ValueError):
    pass


class _Token:
    """Stands for an allowed class that payloads pass as an argument, never call or change."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


def _refuse(what: str) -> RefusedPayload:
    return RefusedPayload(f"payload refused: {what}")


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in ALLOWED_GLOBALS:
            raise _refuse(f"it names {module}.{name}, which is not a tensor reduction (weight payloads "
                          "may hold only tensors, names and bucket metadata)")
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
            return _Token(_TOKENS[key])
        if module == "torch.multiprocessing.reductions":
            return _checked_rebuild(name)
        if key == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if key == ("multiprocessing.resource_sharer", "DupFd"):
            return _local_dup_fd_class()
        from weight_sync.bucket import FlattenedTensorMetadata

        return type("FlattenedTensorMetadata", (FlattenedTensorMetadata,), {})


def _cls(token: Any, base: type) -> type:
    if not isinstance(token, _Token) or not issubclass(token.cls, base):
        raise _refuse(f"expected a {base.__name__} class argument, got {type(token).__name__}")
    return token.cls


def _check(value: Any, types: Union[type, tuple], what: str) -> Any:
    if not isinstance(value, types) or isinstance(value, bool) and types is int:
        raise _refuse(f"{what} has type {type(value).__name__}")
    return value


def _checked_rebuild(name: str) -> Callable:
    from torch.multiprocessing import reductions as R

    def rebuild_tensor(cls, storage, metadata):
        _cls(cls, torch.Tensor)
        _check(storage, torch.TypedStorage, "rebuild_tensor's storage")
        offset, size, stride, requires_grad = _check(metadata, tuple, "rebuild_tensor's metadata")
        for v in (offset, *size, *stride):
            if _check(v, int, "a tensor offset, size or stride") < 0:
                raise _refuse("a negative tensor offset, size or stride")
        # within the storage: never grow it (a grown storage holds uninitialised memory)
        last = offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else -1
        elements = storage._size()  # TypedStorage.size() without its deprecation warning
        if len(size) != len(stride) or last >= elements:
            raise _refuse(f"a tensor of size {list(size)} reaches past its storage of {elements} elements")
        return R.rebuild_tensor(torch.Tensor, storage, (offset, tuple(size), tuple(stride), bool(requires_grad)))

    def rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
                            requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
                            event_sync_required):
        _cls(tensor_cls, torch.Tensor)
        _cls(storage_cls, torch.UntypedStorage)
        _check(dtype, torch.dtype, "dtype")
        for v in (*tensor_size, *tensor_stride, tensor_offset, storage_device, storage_size_bytes,
                  storage_offset_bytes, ref_counter_offset):
            if _check(v, int, "a CUDA tensor's size, stride, offset or device") < 0:
                raise _refuse("a negative CUDA tensor size, stride, offset or device")
        if ref_counter_offset >= _CUDA_REF_COUNTER_SLOTS:  # torch decrements that slot, unchecked
            raise _refuse(f"ref_counter_offset {ref_counter_offset} is outside the ref-counter file")
        for v in (storage_handle, ref_counter_handle, event_handle):
            _check(v, (bytes, type(None)), "a CUDA IPC handle")
        return R.rebuild_cuda_tensor(torch.Tensor, tuple(tensor_size), tuple(tensor_stride), tensor_offset,
                                     torch.UntypedStorage, dtype, storage_device, storage_handle,
                                     storage_size_bytes, storage_offset_bytes, bool(requires_grad),
                                     ref_counter_handle, ref_counter_offset, event_handle,
                                     bool(event_sync_required))

    def rebuild_storage_fd(cls, df, size):
        _cls(cls, torch.UntypedStorage)
        if not getattr(type(df), "_tandem_checked", False):
            raise _refuse(f"a shared-memory descriptor has type {type(df).__name__}")
        return R.rebuild_storage_fd(torch.UntypedStorage, df, _check(size, int, "a storage size"))

    def rebuild_storage_empty(cls):
        return R.rebuild_storage_empty(_cls(cls, torch.UntypedStorage))

    def rebuild_typed_storage(storage, dtype):
        _check(storage, torch.UntypedStorage, "a typed storage's storage")
        return R.rebuild_typed_storage(storage, _check(dtype, torch.dtype, "dtype"))

    def rebuild_typed_storage_child(storage, storage_type):
        _check(storage, torch.UntypedStorage, "a typed storage's storage")
        return R.rebuild_typed_storage_child(storage, _cls(storage_type, torch.TypedStorage))

    return locals()[name]


def _local_dup_fd_class() -> type:
    """DupFd that a payload can only describe, never create (creating one registers a descriptor
    of this process for sharing), and whose detach() fetches a descriptor only from a sender's
    multiprocessing listener: a socket in a pymp-* directory directly under the temp dir that this
    user owns with mode 0700, as multiprocessing makes them, so no other user can plant one."""
    from multiprocessing.resource_sharer import DupFd

    def new(cls, *args):
        if args:
            raise _refuse("a payload may not create a shared-memory descriptor")
        return object.__new__(cls)

    def init(self, *args):
        raise _refuse("a payload may not create a shared-memory descriptor")

    def detach(self) -> int:
        ident = getattr(self, "_id", None)
        address = ident[0] if isinstance(ident, tuple) and len(ident) == 2 else None
        if not (isinstance(address, str) and isinstance(ident[1], int) and _is_listener(address)):
            raise _refuse(f"a shared-memory descriptor points at {address!r}, not a local multiprocessing listener")
        return DupFd.detach(self)

    return type("DupFd", (DupFd,), {"__new__": new, "__init__": init, "detach": detach, "_tandem_checked": True})


def _is_listener(address: str) -> bool:
    import stat

    path = os.path.realpath(address)
    parent = os.path.dirname(path)
    if os.path.dirname(parent) != os.path.realpath(tempfile.gettempdir()) or \
            not os.path.basename(parent).startswith("pymp-"):
        return False
    try:
        info, sock = os.stat(parent), os.stat(path)
    except OSError:
        return False
    return (info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
            and sock.st_uid == os.getuid() and stat.S_ISSOCK(sock.st_mode))


def serialize(obj: Any, as_text: bool = False) -> Union[bytes, str]:
    """Pickle `obj` (e.g. [(name, tensor)] or a bucket payload) with tensors by reference."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor and storage reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if as_text else data


def deserialize(data: Union[bytes, str]) -> Any:
    """The object `serialize` wrote, through the allowlist; base64 text is decoded first."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise _refuse(f"not base64 ({exc})") from exc
    try:
        return _AllowlistUnpickler(data).load()
    except RefusedPayload:
        raise
    except Exception as exc:  # truncated or corrupt pickle, dead sender, bad IPC handle, wrong arity
        raise RefusedPayload(f"payload could not be read: {type(exc).__name__}: {exc}") from exc
