"""An abort that arrives while a request is still being built (its grammar checked, its template
rendered) ends the request once it is sent, as SGLang's does; it ends nothing sent after it."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from engine.api.early_aborts import EXACT, MAX_RID_CHARS, PREFIX, EarlyAborts
from tests.hold import Hold

LONG = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
IDS = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()


def _generate_in_thread(engine: Any, **kwargs: Any) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=engine.generate(**kwargs)))
    thread.start()
    return thread, result


@pytest.mark.parametrize("how", ["rid", "all", "prefix", "fanned_out"])
def test_an_abort_during_the_build_ends_the_request(engine, monkeypatch, how):
    slow = Hold()
    monkeypatch.setattr(engine.builder, "build", slow.around(engine.builder.build))
    params = {**LONG, "n": 2} if how == "fanned_out" else LONG
    thread, result = _generate_in_thread(engine, input_ids=IDS, sampling_params=params, rid="late-1")
    assert slow.started.wait(30)
    if how == "all":
        engine.abort_request(abort_all=True)
    elif how == "prefix":
        engine.abort_request(rid="late-", prefix=True)
    else:
        engine.abort_request(rid="late-1")
    slow.release.set()
    thread.join(60)
    outs = result["out"] if isinstance(result["out"], list) else [result["out"]]
    assert len(outs) == (2 if how == "fanned_out" else 1)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        assert len(out["output_ids"]) < LONG["max_new_tokens"]


def test_an_abort_before_the_request_began_or_of_another_rid_ends_nothing(engine):
    engine.abort_request(abort_all=True)  # before: the next request is not one it could mean
    out = engine.generate(input_ids=IDS, sampling_params={**LONG, "max_new_tokens": 5}, rid="after-all")
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    engine.abort_request(rid="other")
    assert len(engine.generate(input_ids=IDS, sampling_params={**LONG, "max_new_tokens": 5})["output_ids"]) == 5


def test_only_aborts_since_the_mark_name_a_rid():
    aborts = EarlyAborts(keep=3)
    aborts.record("a")
    mark = aborts.mark()
    assert aborts.named(["a", "b"], mark) == []
    aborts.record("b")
    aborts.record("pre-", PREFIX)
    aborts.record("c", EXACT)  # c was in flight: the core ends c alone, not c's expansions
    assert aborts.named(["a", "b", "b-0", "b_1", "b-x_2", "bb", "pre-x", "c", "c-0"], mark) == [
        "b", "b-0", "b_1", "b-x_2", "pre-x", "c"]
    aborts.record(None)
    assert aborts.named(["a", "z"], mark) == ["a", "z"]  # everything


def test_an_abort_all_outlives_any_number_of_aborts_by_rid():
    """Client disconnects abort by rid; thousands of them after slime's abort_all must not push it
    out of memory while a request is being built."""
    aborts = EarlyAborts(keep=4)
    mark = aborts.mark()
    aborts.record(None)
    for i in range(100):
        aborts.record(f"gone-{i}")
    aborts.record("x" * (MAX_RID_CHARS + 1))  # not remembered: it would pin memory
    assert aborts.named(["late"], mark) == ["late"]
    later = aborts.mark()
    aborts.record("gone-x")
    assert aborts.named(["late", "gone-x"], later) == ["gone-x"]
