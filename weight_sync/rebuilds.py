"""Checked stand-ins for the functions torch's multiprocessing reductions name in a payload.

A payload calls these with arguments it chose, so each one checks every argument's type and
range against what torch's own reductions produce (torch/multiprocessing/reductions.py) before
calling torch's function with the real classes: a class argument arrives as a `Token` (made by
the unpickler) and is mapped back to the one real class it may be; anything else is refused with
its name. SGLang's patched CUDA rebuild (the device as a GPU UUID string) maps onto the same check.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from typing import Any, Callable, Union

import torch

CUDA_REF_COUNTER_SLOTS = 10000  # torch's CUDA IPC ref-counter file (CUDA_IPC_REF_COUNTER_FILE_SIZE)
SHM_HEADER_BYTES = 64  # torch's refcounted shared-memory file: a header, then the storage's bytes
_SHM_NAME = re.compile(rb"/torch_\d+_\d+_\d+")  # the names torch gives its shared-memory files


class RefusedPayload(ValueError):
    pass


class Token:
    """Stands for an allowed class that payloads pass as an argument, never call or change."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


def refuse(what: str) -> RefusedPayload:
    return RefusedPayload(f"payload refused: {what}")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _cls(token: Any, allowed: tuple[type, ...], what: str) -> type:
    expected = " or ".join(_name(c) for c in allowed)
    if not isinstance(token, Token):
        raise refuse(f"{what} must be the class {expected}; got a {type(token).__name__} value")
    if token.cls not in allowed:
        raise refuse(f"{what} is {_name(token.cls)}; expected {expected}")
    return token.cls


def _check(value: Any, types: Union[type, tuple], what: str) -> Any:
    if not isinstance(value, types) or isinstance(value, bool) and types is int:
        raise refuse(f"{what} has type {type(value).__name__}")
    return value


def _non_negative_ints(values: Any, what: str) -> None:
    for v in values:
        if _check(v, int, what) < 0:
            raise refuse(f"a negative {what}")


def _check_view(offset: int, size: Any, stride: Any, elements: int, what: str) -> None:
    """A view of `size`/`stride` at `offset` stays inside a storage of `elements` (never grows it:
    a grown storage holds uninitialised memory, a CUDA IPC one memory that is not the sender's)."""
    _check(size, tuple, f"{what}'s size")
    _check(stride, tuple, f"{what}'s stride")
    _non_negative_ints((offset, *size, *stride), "tensor offset, size or stride")
    last = offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else -1
    if len(size) != len(stride) or last >= elements:
        raise refuse(f"a tensor of size {list(size)} reaches past its storage of {elements} elements")


def device_for_uuid(uuid: str) -> int:
    """The local CUDA device index whose UUID SGLang's patched reduction wrote."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise refuse(f"GPU {uuid!r} is not visible to this engine (CUDA IPC needs sender and engine on the "
                 "same GPU; check CUDA_VISIBLE_DEVICES of both)")


def checked_rebuild(name: str) -> Callable:
    """The checked stand-in for torch.multiprocessing.reductions.<name> (or SGLang's CUDA one)."""
    return _REBUILDS[name]


def _rebuild_tensor(cls, storage, metadata):
    from torch.multiprocessing import reductions as R

    _cls(cls, (torch.Tensor, torch.nn.Parameter), "rebuild_tensor's class")
    _check(storage, torch.TypedStorage, "rebuild_tensor's storage")
    offset, size, stride, requires_grad = _check(metadata, tuple, "rebuild_tensor's metadata")
    _check_view(offset, size, stride, storage._size(), "rebuild_tensor")  # _size(): no deprecation warning
    return R.rebuild_tensor(torch.Tensor, storage, (offset, tuple(size), tuple(stride), bool(requires_grad)))


def _rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                         storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
                         requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
                         event_sync_required):
    """torch's reduce_tensor for a CUDA tensor: storage_cls is type(tensor._typed_storage()),
    i.e. TypedStorage; handles are bytes (event_handle None when no sync is needed)."""
    from torch.multiprocessing import reductions as R

    _cls(tensor_cls, (torch.Tensor, torch.nn.Parameter), "a CUDA tensor's class")
    real_storage_cls = _cls(storage_cls, (torch.TypedStorage, torch.UntypedStorage), "a CUDA tensor's storage class")
    _check(dtype, torch.dtype, "dtype")
    _non_negative_ints((storage_device, storage_size_bytes, storage_offset_bytes, ref_counter_offset),
                       "CUDA device, storage size, storage offset or ref-counter offset")
    _check_view(tensor_offset, tensor_size, tensor_stride, storage_size_bytes // dtype.itemsize, "a CUDA tensor")
    size, stride = tuple(tensor_size), tuple(tensor_stride)
    if ref_counter_offset >= CUDA_REF_COUNTER_SLOTS:  # torch decrements that slot, unchecked
        raise refuse(f"ref_counter_offset {ref_counter_offset} is outside the ref-counter file")
    for v in (storage_handle, ref_counter_handle, event_handle):
        _check(v, (bytes, type(None)), "a CUDA IPC handle")
    return R.rebuild_cuda_tensor(torch.Tensor, size, stride, tensor_offset, real_storage_cls, dtype,
                                 storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
                                 bool(requires_grad), ref_counter_handle, ref_counter_offset, event_handle,
                                 bool(event_sync_required))


def _rebuild_cuda_tensor_by_uuid(*args):
    """SGLang's `_rebuild_cuda_tensor_modified`: torch's arguments with the device (index 6) given
    as the GPU's UUID string, so sender and engine may number their GPUs differently."""
    if len(args) != 15:
        raise refuse(f"SGLang's CUDA rebuild takes 15 arguments, got {len(args)}")
    device = args[6]
    if isinstance(device, str):
        device = device_for_uuid(device)
    return _rebuild_cuda_tensor(*args[:6], device, *args[7:])


def _rebuild_storage_fd(cls, df, size):
    from torch.multiprocessing import reductions as R

    _cls(cls, (torch.UntypedStorage,), "rebuild_storage_fd's class")
    if not getattr(type(df), "_tandem_checked", False):
        raise refuse(f"a shared-memory descriptor has type {type(df).__name__}")
    if _check(size, int, "a storage size") < 0:
        raise refuse("a negative storage size")
    return R.rebuild_storage_fd(torch.UntypedStorage, _SizedFd(df, size), size)


class _SizedFd:
    """The fetched descriptor, refused if its file is smaller than the storage mapped on it (a
    read past the file's end would kill the process with SIGBUS)."""

    def __init__(self, df: Any, size: int) -> None:
        self.df, self.size = df, size

    def detach(self) -> int:
        fd = self.df.detach()
        if os.fstat(fd).st_size < self.size:
            os.close(fd)
            raise refuse(f"a storage of {self.size} bytes reaches past its shared-memory descriptor's file")
        return fd


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    """The file_system sharing strategy: a named shared-memory file and the sender's shm manager
    socket. Works between unrelated processes (no authkey), unlike a passed descriptor."""
    from torch.multiprocessing import reductions as R

    _cls(cls, (torch.UntypedStorage, torch.TypedStorage), "rebuild_storage_filename's class")
    _check(size, int, "a storage size")
    if dtype is not None:
        _check(dtype, torch.dtype, "dtype")
    nbytes = size * (dtype.itemsize if dtype is not None else 1)
    _check_shm_file(_check(handle, bytes, "a shared-memory name"), nbytes)
    if not _is_shm_manager(_check(manager, bytes, "a shared-memory manager")):
        raise refuse(f"shared-memory manager {manager!r} is not a torch_shm_manager socket of this user")
    return R.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size, dtype)


def _check_shm_file(handle: bytes, nbytes: int) -> None:
    """Only torch's own shared-memory files, of this user, and never grown (opening with a larger
    size would extend the file) or touched past their end."""
    if not _SHM_NAME.fullmatch(handle):
        raise refuse(f"shared-memory name {handle!r} is not one torch makes")
    if nbytes < 0:
        raise refuse("a negative storage size")
    try:
        info = os.stat(b"/dev/shm" + handle)
    except OSError as exc:
        raise refuse(f"shared-memory file {handle.decode()} cannot be opened ({exc.strerror}): the "
                     "sender must keep its tensors alive until the update returns") from exc
    if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
        raise refuse(f"shared-memory file {handle.decode()} is not a file of this user")
    if nbytes + SHM_HEADER_BYTES > info.st_size:
        raise refuse(f"a storage of {nbytes} bytes reaches past shared-memory file {handle.decode()}")


def _is_shm_manager(manager: bytes) -> bool:
    """torch_shm_manager's socket: manager.sock in a torch-shm-dir-* directory that this user owns
    with mode 0700 (mkdtemp), so no other user can plant one."""
    path = os.path.realpath(os.fsdecode(manager))
    parent = os.path.dirname(path)
    if os.path.basename(path) != "manager.sock" or not os.path.basename(parent).startswith("torch-shm-dir-"):
        return False
    return _owned_private_dir_with_socket(parent, path)


def is_mp_listener(address: str) -> bool:
    """A multiprocessing resource-sharer socket: in a pymp-* directory directly under the temp
    dir, owned by this user with mode 0700, as multiprocessing makes them."""
    path = os.path.realpath(address)
    parent = os.path.dirname(path)
    if os.path.dirname(parent) != os.path.realpath(tempfile.gettempdir()) or \
            not os.path.basename(parent).startswith("pymp-"):
        return False
    return _owned_private_dir_with_socket(parent, path)


def _owned_private_dir_with_socket(parent: str, path: str) -> bool:
    try:
        info, sock = os.stat(parent), os.stat(path)
    except OSError:
        return False
    return (info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
            and sock.st_uid == os.getuid() and stat.S_ISSOCK(sock.st_mode))


def _rebuild_storage_empty(cls):
    from torch.multiprocessing import reductions as R

    return R.rebuild_storage_empty(_cls(cls, (torch.UntypedStorage,), "rebuild_storage_empty's class"))


def _rebuild_typed_storage(storage, dtype):
    from torch.multiprocessing import reductions as R

    _check(storage, torch.UntypedStorage, "a typed storage's storage")
    return R.rebuild_typed_storage(storage, _check(dtype, torch.dtype, "dtype"))


def _rebuild_typed_storage_child(storage, storage_type):
    """Legacy typed storages (torch.FloatStorage, ...): reduce_typed_storage_child."""
    from torch.multiprocessing import reductions as R

    _check(storage, torch.UntypedStorage, "a typed storage's storage")
    return R.rebuild_typed_storage_child(storage, _cls(storage_type, LEGACY_STORAGES, "a typed storage class"))


LEGACY_STORAGES: tuple[type, ...] = tuple(sorted(
    (c for c in torch._storage_classes if issubclass(c, torch.TypedStorage) and c is not torch.TypedStorage),
    key=_name))
_REBUILDS: dict[str, Callable] = {
    "rebuild_tensor": _rebuild_tensor, "rebuild_cuda_tensor": _rebuild_cuda_tensor,
    "_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_by_uuid,
    "rebuild_storage_fd": _rebuild_storage_fd, "rebuild_storage_filename": _rebuild_storage_filename,
    "rebuild_storage_empty": _rebuild_storage_empty, "rebuild_typed_storage": _rebuild_typed_storage,
    "rebuild_typed_storage_child": _rebuild_typed_storage_child,
}
