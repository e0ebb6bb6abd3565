"""Whether a weight can be copied into its parameter, found out before any parameter is written.

`Tensor.copy_` casts between most floating dtypes but not from every one torch can hold (e.g.
float4_e2m1fn_x2 has no copy kernel), and which pairs work depends on the devices. A one-element
trial copy per (source dtype and device, parameter dtype and device) answers it exactly, so a
refused update leaves the weights as they were.
"""

from __future__ import annotations

from typing import Optional

import torch


class WeightsPartlyWritten(RuntimeError):
    """A load failed after its first parameter write: the model may mix old and new weights."""


class CastCheck:
    """Trial copies for one update, remembered per dtype/device pair (a few per update)."""

    def __init__(self) -> None:
        self._failures: dict[tuple, Optional[str]] = {}

    def check(self, name: str, source: torch.Tensor, param: torch.Tensor) -> None:
        """Raise ValueError naming `name` when `source` cannot be copied into `param`."""
        if source.dtype == param.dtype:
            return
        key = (source.dtype, source.device, param.dtype, param.device)
        if key not in self._failures:
            self._failures[key] = _trial_copy(source, param)
        failure = self._failures[key]
        if failure is not None:
            src = str(source.dtype).removeprefix("torch.")
            dst = str(param.dtype).removeprefix("torch.")
            raise ValueError(f"weight {name!r} has dtype {src}, which cannot be cast to the parameter's {dst} "
                             f"({failure}); send it as {dst}, float32 or bfloat16")

    def check_dtype(self, name: str, dtype: torch.dtype, param: torch.Tensor) -> None:
        """The same for a tensor known only by its dtype (a checkpoint header), read on the CPU."""
        self.check(name, torch.empty(1, dtype=dtype), param)


def _trial_copy(source: torch.Tensor, param: torch.Tensor) -> Optional[str]:
    """None if one element of `source` copies into a tensor like `param`, else the reason."""
    sample = source[(slice(0, 1),) * source.dim()] if source.numel() else torch.empty(
        1, dtype=source.dtype, device=source.device)
    try:
        torch.empty(sample.shape, dtype=param.dtype, device=param.device).copy_(sample)
    except Exception as exc:  # NotImplementedError, RuntimeError: whatever copy_ raises here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no copy kernel'}"
    return None
