"""What the benchmark asks of the device: its name, synchronisation and peak memory.

GPU peak memory is torch's allocator high-water mark (reset per run); on the CPU it is the
process's peak resident set, which cannot be reset, so it covers everything run so far.
"""

from __future__ import annotations

import gc
import platform
import resource

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model() or platform.processor() or "cpu"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def allocated_gb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def free_memory(device: torch.device) -> None:
    """Collect dropped models (reference cycles included) and hand cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
