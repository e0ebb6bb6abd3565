"""The ready line says where start-up time went (issue 25: serve's 60 s to ready for 8B)."""

from __future__ import annotations

import logging
import sys
import time

from engine.core.startup_clock import StartupClock, process_age_s


def test_phases_add_up_and_are_named():
    clock = StartupClock()
    with clock.phase("weights"):
        time.sleep(0.05)
    with clock.phase("weights"):  # a phase entered twice accumulates
        time.sleep(0.05)
    with clock.phase("runner"):
        pass
    assert 0.09 < clock.phases["weights"] < 1.0 and clock.phases["runner"] < 0.05
    summary = clock.summary()
    assert summary.startswith("startup=") and "weights 0.1" in summary and "runner 0.0" in summary


def test_process_age_counts_the_imports_before_the_engine():
    age = process_age_s()
    if sys.platform.startswith("linux"):
        assert age is not None and 0.0 < age < 7 * 24 * 3600
        time.sleep(0.2)
        assert process_age_s() >= age + 0.1


def test_the_ready_line_carries_the_phases(tiny_model_dir, caplog):
    from engine import Engine

    with caplog.at_level(logging.INFO, logger="tandem"):
        Engine(model_path=tiny_model_dir, dtype="float32", device="cpu").shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tandem ready")]
    assert len(ready) == 1 and "startup=" in ready[0]
    assert all(f"{phase} " in ready[0] for phase in ("weights", "kv_pool", "tokenizer", "runner"))


def test_a_spawned_core_tells_its_spawn_from_its_imports(monkeypatch):
    from engine.core import startup_clock

    monkeypatch.setattr(startup_clock, "_entry_age_s", None)
    assert "spawn" not in StartupClock().summary()  # an in-process engine: no spawn to tell
    startup_clock.mark_entry()
    clock = StartupClock()
    assert 0.0 <= clock.spawn_s <= clock.before_engine_s
    assert f"(before engine {clock.before_engine_s:.1f} (spawn {clock.spawn_s:.1f})" in clock.summary()
