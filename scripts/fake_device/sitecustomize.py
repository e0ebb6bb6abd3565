"""Loaded by every Python process started with this folder on PYTHONPATH (the serve process, the
core process it spawns, a bench): installs the fake device when TANDEM_FAKE_DEVICE is set.
Used with scripts/fake_device/fake_device.py (see its doc)."""

import os

if os.environ.get("TANDEM_FAKE_DEVICE"):
    import fake_device

    fake_device.install(os.environ["TANDEM_FAKE_DEVICE"])
