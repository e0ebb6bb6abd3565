"""The attention backends, one BackendSpec each: every list of backends in the code derives from here.

Adding a backend is one module (a subclass of engine.attention.base.AttentionBackend) and one
BackendSpec below. ServerArgs' choices and its deterministic check, the CUDA-graph decision at
start-up, the start-up model check and the trainer's PackedAttention read these specs. The
module is imported only when the backend is created, so flashinfer (or triton) need not be
installed for the others. No torch import here: engine.config reads this module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


@dataclass(frozen=True)
class BackendSpec:
    name: str  # the --attention-backend value
    loader: Union[str, Callable[[], type]]  # "module:Class", or a function that imports it
    supports_cuda_graph: bool  # implements the graph hooks of AttentionBackend (decode)
    supports_deterministic: bool  # accepts deterministic=True (DESIGN section 4)
    dtypes: Optional[tuple[str, ...]] = None  # KV/query dtypes it runs; None: any
    devices: tuple[str, ...] = ("cuda",)  # where it runs
    head_dims: Optional[tuple[int, ...]] = None  # head sizes it has kernels for; None: any
    supports_cascade: bool = False  # accepts cascade= (shared-prefix decode, engine/attention/cascade.py)

    def load(self) -> type:
        if callable(self.loader):
            return self.loader()
        module, _, attr = self.loader.partition(":")
        return getattr(importlib.import_module(module), attr)

    def check_model(self, dtype: str, head_dim: int, device_type: str) -> None:
        """At start-up, before the model loads: a backend without kernels for this model would
        otherwise fail deep inside its first forward pass."""
        others = " or ".join(n for n in backend_names() if n != self.name)
        if self.dtypes is not None and dtype not in self.dtypes:
            raise ValueError(f"attention_backend {self.name!r} supports {' and '.join(self.dtypes)} only, got "
                             f"{dtype}: use --dtype {self.dtypes[-1]}, or --attention-backend {others}")
        if self.head_dims is not None and head_dim not in self.head_dims:
            raise ValueError(f"attention_backend {self.name!r} supports head_dim "
                             f"{', '.join(map(str, self.head_dims))}, this model has {head_dim}: "
                             f"use --attention-backend {others}")
        if device_type not in self.devices:
            raise ValueError(f"attention_backend {self.name!r} runs on {', '.join(self.devices)}, not "
                             f"{device_type}: use --attention-backend {others}")


BACKENDS: tuple[BackendSpec, ...] = (
    # the reference: plain torch, any dtype and device; the oracle of the tests
    BackendSpec("torch", "engine.attention.torch_native:TorchNativeAttentionBackend",
                supports_cuda_graph=False, supports_deterministic=True, devices=("cpu", "cuda")),
    # split-KV Triton kernels; on the CPU only under TRITON_INTERPRET=1 (tests)
    BackendSpec("triton", "engine.attention.triton:TritonAttentionBackend",
                supports_cuda_graph=True, supports_deterministic=True, devices=("cuda", "cpu"),
                supports_cascade=True),
    BackendSpec("flashinfer", "engine.attention.flashinfer:FlashInferAttentionBackend",
                supports_cuda_graph=True, supports_deterministic=False, dtypes=("float16", "bfloat16"),
                head_dims=(64, 128, 256)),
)
DEFAULT_BACKEND = {"cuda": "triton", "cpu": "torch"}  # by device type, when none is given


def backend_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in BACKENDS)


def deterministic_backends() -> tuple[str, ...]:
    return tuple(spec.name for spec in BACKENDS if spec.supports_deterministic)


def get_backend_spec(name: str) -> BackendSpec:
    for spec in BACKENDS:
        if spec.name == name:
            return spec
    raise ValueError(f"attention_backend must be one of {', '.join(backend_names())}; got {name!r}")


def default_backend(device_type: str) -> str:
    return DEFAULT_BACKEND.get(device_type, "torch")


def create_attention_backend(name: str, **options: Any) -> Any:
    """options: backend settings such as deterministic=True (fixed KV splits, see DESIGN §4)."""
    return get_backend_spec(name).load()(**options)
