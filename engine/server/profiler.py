"""/start_profile and /stop_profile: a torch.profiler trace of the server process (the core's
thread included; CPU always, CUDA when there is a GPU), written as a Chrome trace.

Kineto wants start and stop on one thread, so both run on this profiler's own worker thread
(which also keeps the trace export off the event loop)."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA,
              "CUDA": torch.profiler.ProfilerActivity.CUDA}


class Profiler:
    def __init__(self) -> None:
        self.profile: Optional[torch.profiler.profile] = None
        self.waiting: Optional[object] = None  # the token of a start deferred by start_step
        self.output_dir = ""
        self.last_trace: Optional[str] = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-profiler")

    async def on_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    @property
    def running(self) -> bool:
        return self.profile is not None

    def check_idle(self) -> None:
        if self.running or self.waiting is not None:
            raise ValueError("a profile is already running or scheduled: POST /stop_profile first")

    def start(self, output_dir: Optional[str] = None, activities: Optional[list[str]] = None,
              with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None) -> None:
        if self.running:
            raise ValueError("a profile is already running: POST /stop_profile first")
        self.check_activities(activities)  # an unknown name fails here, before anything starts
        self.output_dir = self.check_output_dir(output_dir)
        self.profile = torch.profiler.profile(activities=self._activities(activities),
                                              with_stack=bool(with_stack), record_shapes=bool(record_shapes),
                                              experimental_config=_all_threads())
        self.profile.start()

    def stop(self) -> str:
        """Stops and writes the trace; returns its path."""
        if not self.running:
            if self.waiting is not None:  # the scheduled start is called off
                self.waiting = None
                return "(none: the profile had not started)"
            raise ValueError("no profile is running: POST /start_profile first")
        profile, self.profile = self.profile, None
        profile.stop()
        path = os.path.join(self.output_dir, f"tandem-{int(time.time() * 1000)}.trace.json")
        try:
            profile.export_chrome_trace(path)
        except OSError as exc:  # e.g. output_dir removed meanwhile: the profile is over either way
            raise ValueError(f"the trace could not be written to {path}: {exc}") from None
        self.last_trace = path
        return path

    @staticmethod
    def check_output_dir(output_dir: Optional[str]) -> str:
        """The trace folder (SGLang's default from SGLANG_TORCH_PROFILER_DIR), created now."""
        output_dir = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        try:
            os.makedirs(output_dir, exist_ok=True)
        except (OSError, ValueError) as exc:  # read-only, a file in the way, a NUL in the name
            raise ValueError(f"output_dir {output_dir!r} cannot be created: {exc}") from None
        return output_dir

    def schedule(self) -> object:
        """A start is coming (start_now, or start_after_steps for start_step): set at once, so a
        second /start_profile is refused; -> its token (a start called off and another scheduled
        is not this one)."""
        self.check_idle()
        self.waiting = object()
        return self.waiting

    async def start_after_steps(self, engine: Any, token: object, until: int, start: Any,
                                poll_s: float = 0.05) -> bool:
        """SGLang's start_step, after `schedule`: `start` (on this profiler's thread) once the core
        has run `until` forward passes; False when /stop_profile called it off first."""
        try:
            while self.waiting is token and (await asyncio.to_thread(engine.get_stats)).num_steps < until:
                await asyncio.sleep(poll_s)
            if self.waiting is not token:
                return False
            await self.on_thread(start)
            return True
        finally:
            if self.waiting is token:
                self.waiting = None

    async def start_now(self, token: object, start: Any) -> None:
        """`start` (on this profiler's thread) for the schedule `token`; a failed start frees it."""
        try:
            await self.on_thread(start)
        finally:
            if self.waiting is token:
                self.waiting = None

    async def stop_after_steps(self, engine: Any, profile: Any, start: int, num_steps: int,
                               poll_s: float = 0.05) -> None:
        """Stop `profile` once the core has run `num_steps` forward passes after step `start`
        (SGLang's num_steps); a later profile (this one stopped by hand) is not this one's to stop."""
        while self.profile is profile and (await asyncio.to_thread(engine.get_stats)).num_steps < start + num_steps:
            await asyncio.sleep(poll_s)
        if profile is not None and self.profile is profile:
            await self.on_thread(self.stop)

    @staticmethod
    def check_activities(names: Optional[list[str]]) -> None:
        Profiler._activities(names)

    @staticmethod
    def _activities(names: Optional[list[str]]) -> list:
        if not names:
            return [ACTIVITIES["CPU"]] + ([ACTIVITIES["GPU"]] if torch.cuda.is_available() else [])
        unknown = [n for n in names if n.upper() not in ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown profiler activity {unknown[0]!r}; use CPU and/or GPU")
        return sorted({ACTIVITIES[n.upper()] for n in names}, key=str)


def _all_threads() -> Any:
    """The core runs on its own thread: without this only the caller's thread is traced."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: this thread only
        return None
