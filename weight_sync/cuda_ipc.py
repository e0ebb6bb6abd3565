"""Tensors between processes by reference: CUDA IPC handles on the GPU, shared memory on the CPU.

`serialize` pickles with torch's multiprocessing reductions (what SGLang's
MultiprocessingSerializer does): a CUDA tensor becomes an IPC handle into the sender's memory (no
copy), a CPU tensor a shared-memory file descriptor. The sender keeps the tensors alive until the
receiver has loaded them. `deserialize` never runs plain `pickle.loads`: it accepts exactly the
globals those reductions emit, plus the bucket metadata class, and refuses any other by name
(os.system, builtins.eval, torch.hub.load, ... all stop here). Both accept base64 text, the
form the HTTP route carries.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any, Union

import torch

_REDUCTIONS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
               "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.multiprocessing.reductions", name) for name in _REDUCTIONS}
    | {("torch", "Size"), ("torch", "Tensor"), ("torch", "device"),
       ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
       ("multiprocessing.resource_sharer", "DupFd"), ("collections", "OrderedDict"),
       ("weight_sync.bucket", "FlattenedTensorMetadata")}
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
)


class RefusedPayload(ValueError):
    pass


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise RefusedPayload(f"payload refused: it names {module}.{name}, which is not a tensor "
                                 "reduction (weight payloads may hold only tensors, names and bucket metadata)")
        return super().find_class(module, name)


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
    import torch.multiprocessing  # noqa: F401

    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise RefusedPayload(f"payload refused: not base64 ({exc})") from exc
    try:
        return _AllowlistUnpickler(io.BytesIO(data)).load()
    except RefusedPayload:
        raise
    except Exception as exc:  # truncated or corrupt pickle, dead sender, bad IPC handle
        raise RefusedPayload(f"payload could not be read: {type(exc).__name__}: {exc}") from exc
