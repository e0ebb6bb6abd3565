"""Ctrl-C / SIGTERM during `tandem train`: the command exits within seconds with 130 / 143, says it
was interrupted and where the partial run is, prints no traceback, and leaves no Ray process (raylet,
GCS, agents, engine actors) behind, whether the signal comes while Ray starts or between steps. An
engine actor killed mid-run is one line too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SMALL = ["--num-engines", "1", "--steps", "500", "--prompts-per-step", "2", "--warm-start-steps", "0",
         "--wandb", "false", "--save-checkpoint", "false"]


class Run:
    """`tandem train` in its own session (so every process it starts can be found by session id)."""

    def __init__(self, out: Path, *flags: str) -> None:
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.main", "train", "--output-dir", str(out),
                                      *SMALL, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, ready, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "the run never got there"
            time.sleep(0.05)

    def steps_done(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def stop(self, signum: int) -> tuple[int, str, float]:
        start = time.monotonic()
        self.proc.send_signal(signum)
        rc = self.proc.wait(timeout=30)
        return rc, self.proc.stderr.read(), time.monotonic() - start

    def leftovers(self) -> list[str]:
        """Live processes of the run's session, a few seconds after it exited (zombies are dead)."""
        ps = []
        for _ in range(50):
            ps = subprocess.run(["ps", "-eo", "sid=,stat=,args="], capture_output=True, text=True).stdout.splitlines()
            ps = [line for line in ps if line.split()[0] == str(self.proc.pid) and not line.split()[1].startswith("Z")]
            if not ps:
                break
            time.sleep(0.1)
        return ps


def _assert_interrupted(run: Run, rc: int, err: str, seconds: float, signum: int) -> None:
    name = signal.Signals(signum).name
    assert rc == 128 + signum, err
    assert "Traceback" not in err, err
    done = run.steps_done()
    assert err.strip().splitlines()[-1].endswith(
        f"tandem train: interrupted ({name}) after {done} of 500 steps; the partial run is in {run.out} "
        f"(metrics.jsonl, reward_curve.png; no checkpoint)")
    assert all(json.loads(line)["step"] == i + 1 for i, line in enumerate((run.out / "metrics.jsonl").open()))
    assert seconds < 10, f"{seconds:.1f} s to exit"


def test_sigint_between_steps_in_process(tmp_path):
    run = Run(tmp_path / "run", "--engine-backend", "in_process")
    run.wait_for(lambda: run.steps_done() >= 2)
    rc, err, seconds = run.stop(signal.SIGINT)
    _assert_interrupted(run, rc, err, seconds, signal.SIGINT)
    assert 2 <= run.steps_done() < 500 and not (run.out / "checkpoint").exists()


@pytest.mark.parametrize("signum,when", [(signal.SIGTERM, "steps"), (signal.SIGTERM, "ray start")])
def test_signals_with_ray_leave_no_process(tmp_path, signum, when):
    pytest.importorskip("ray")
    run = Run(tmp_path / "run", "--engine-backend", "ray")
    if when == "steps":
        run.wait_for(lambda: run.steps_done() >= 1)
    else:  # the trainer is built, so Ray is starting its GCS, raylet and agents, or the engine actor loads
        run.wait_for(lambda: any(line.startswith("trainer ready") for line in run.lines))
        time.sleep(1.0)
    rc, err, seconds = run.stop(signum)
    _assert_interrupted(run, rc, err, seconds, signum)
    assert run.leftovers() == []


def test_an_engine_actor_killed_mid_run_is_one_line(tmp_path):
    """kill -9 of an engine actor's process (as the OOM killer would): was an ActorDiedError traceback."""
    pytest.importorskip("ray")
    run = Run(tmp_path / "run", "--engine-backend", "ray")
    run.wait_for(lambda: run.steps_done() >= 1)
    ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout.splitlines()
    (engine_pid,) = [int(line.split()[0]) for line in ps
                     if line.split()[1] == str(run.proc.pid) and "ray::EngineActor" in line]
    os.kill(engine_pid, signal.SIGKILL)
    rc = run.proc.wait(timeout=60)
    err = run.proc.stderr.read()
    assert rc == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("tandem train: engine actor ")
    assert " died: The actor is dead because its worker process has died." in err.strip().splitlines()[-1]
    assert run.leftovers() == []


def test_sigint_before_the_run_folder_names_nothing(tmp_path, monkeypatch):
    """Ctrl-C during the preflight (a task factory reading its data, say) says nothing was written; an existing
    empty --output-dir is not reported as a partial run."""
    from tandem.rl import loop
    from tandem.rl.interrupt import RunInterrupted
    from recipes.recipe import Recipe

    def interrupted(*args):
        signal.raise_signal(signal.SIGINT)  # through run()'s handler, as a real Ctrl-C

    monkeypatch.setattr(loop, "preflight", interrupted)
    out = tmp_path / "run"
    out.mkdir()
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where pytest runs as a background job
    with pytest.raises(RunInterrupted) as exc:
        loop.run(Recipe(engine_backend="in_process"), out, quiet=True)
    assert exc.value.code == 130 and list(out.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is before  # run() put the handlers back
