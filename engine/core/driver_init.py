"""start_driver_init: the CUDA driver's initialisation (cuInit) on a thread, while the core's
process is still importing torch and the engine.

A fresh H100's `tandem serve` (8B) spent 4.6-5.1 s in its `config` phase (reading the HF config,
then torch's first look at the GPU, whose cuInit brings up the driver) after 4.0-5.2 s of imports:
one after the other. cuInit is process-wide and needs no torch: called through ctypes (which lets
go of the GIL) it runs beside the imports, and torch's own call later finds the driver up. Only
the driver: no context is made, so no device's memory is touched (the engine may use any of them).

Opt-in until measured on the GPU (TANDEM_EARLY_CUDA_INIT=1; scripts/device_suite.sh readyall).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Optional

logger = logging.getLogger(__name__)
ENV = "TANDEM_EARLY_CUDA_INIT"
LIBRARY = "libcuda.so.1"


def start_driver_init(device: str, environ=os.environ) -> Optional[threading.Thread]:
    """The thread running cuInit, or None: not asked, not a CUDA device, or no driver here."""
    if environ.get(ENV, "0") != "1" or not (device == "auto" or device.startswith("cuda")):
        return None
    thread = threading.Thread(target=_init_driver, name="cuda-driver-init", daemon=True)
    thread.start()
    return thread


def _init_driver() -> None:
    try:
        status = ctypes.CDLL(LIBRARY).cuInit(0)
    except (OSError, AttributeError):  # no NVIDIA driver: torch finds no GPU later, as without this
        return
    if status != 0:  # torch's own cuInit meets the same error and reports it in its words
        logger.debug("cuInit returned %d", status)
