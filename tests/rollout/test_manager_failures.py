"""RolloutManager when engines fail: an unreachable replica's groups go elsewhere; any other failure,
or the rollout cancelled, aborts and cancels the rest of the batch and says which group and engine.
Fake engines (and HttpClients to a port nobody listens on); every test bounds itself."""

from __future__ import annotations

import asyncio

import pytest

from engine_client.http_client import HttpClient
from engine_client.http_errors import EngineUnreachable
from rollout.manager import RolloutManager
from engine.models.parallel_state import free_port

PARAMS = {"max_new_tokens": 2}
BOUND_S = 8.0


def _output(reason: str = "length") -> dict:
    return {"text": "", "output_ids": [7], "meta_info": {"finish_reason": {"type": reason},
                                                         "output_token_logprobs": [[-0.5, 7, None]]}}


class _Engine:
    """Answers at once, fails the rids in `fail` with ValueError, or holds every request until it
    is aborted (hold=True); records what it was sent and asked to abort."""

    def __init__(self, hold: bool = False, fail: tuple = ()) -> None:
        self.hold, self.fail = hold, fail
        self.sent, self.aborted, self.finished = [], [], []
        self._released: dict[str, asyncio.Event] = {}

    async def async_generate(self, rid=None, sampling_params=None, **_):
        self.sent.append(rid)
        await asyncio.sleep(0.01)
        if rid in self.fail:
            raise ValueError(f"refused {rid}")
        if self.hold:
            await self._released.setdefault(rid, asyncio.Event()).wait()
        self.finished.append(rid)
        return [_output("abort" if rid in self.aborted else "length")] * sampling_params["n"]

    async def async_abort_request(self, rid=None, abort_all=False):
        self.aborted.append(rid)
        self._released.setdefault(rid, asyncio.Event()).set()


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a port nobody listens on


def _prompts(k: int) -> list[list[int]]:
    return [[3 + g, 4 + g, 5 + g] for g in range(k)]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def test_groups_of_an_unreachable_engine_go_to_the_others():
    live = _Engine()
    dead = HttpClient(_dead_url())
    manager = RolloutManager([dead, live])
    groups = _run(manager.agenerate(_prompts(8), PARAMS, n=2))
    assert [len(g) for g in groups] == [2] * 8 and len(live.sent) == 8  # every group, once, on the live one
    assert manager.router.load == [0, 0]
    dead.close()


def test_every_engine_unreachable_raises_naming_them():
    urls = [_dead_url(), _dead_url()]
    engines = [HttpClient(url) for url in urls]
    manager = RolloutManager(engines)
    with pytest.raises(EngineUnreachable) as info:
        _run(manager.agenerate(_prompts(3), PARAMS, n=1))
    assert any(url in str(info.value) for url in urls)
    assert "every engine (2) was unreachable" in "".join(getattr(info.value, "__notes__", []))
    assert manager.router.load == [0, 0]
    for engine in engines:
        engine.close()


def test_a_failed_group_aborts_the_rest_of_the_batch_and_names_itself():
    """Without this the other groups went on generating (gather left them running) and the error
    said nothing of which group or engine."""
    engines = [_Engine(hold=True, fail=("x",)), _Engine(hold=True, fail=("x",))]
    manager = RolloutManager(engines)
    manager._tag = "t"  # rids rollout-t-0-<group>
    for e in engines:
        e.fail = ("rollout-t-0-2",)
    with pytest.raises(ValueError, match="refused rollout-t-0-2") as info:
        _run(manager.agenerate(_prompts(6), PARAMS, n=1))
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "rollout group 2, on engine" in notes and "_Engine" in notes
    aborted = sorted(rid for e in engines for rid in e.aborted)
    assert aborted == [f"rollout-t-0-{g}" for g in (0, 1, 3, 4, 5)]  # each on the engine that held it
    assert all(rid in e.sent for e in engines for rid in e.aborted)
    assert manager.router.load == [0, 0]


def test_a_cancelled_rollout_aborts_its_requests_and_leaves_nothing_running():
    engines = [_Engine(hold=True), _Engine(hold=True)]
    manager = RolloutManager(engines)

    async def cancel_midway():
        rollout = asyncio.ensure_future(manager.agenerate(_prompts(4), PARAMS, n=3))
        while sum(len(e.sent) for e in engines) < 4:
            await asyncio.sleep(0.01)
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        return [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_run_group"]

    assert _run(cancel_midway()) == []  # no group task left behind
    assert sorted(rid for e in engines for rid in e.aborted) == sorted(
        f"{rid}-{i}" for e in engines for rid in e.sent for i in range(3))  # every sample of every group
    assert manager.router.load == [0, 0]


class _Dying:
    """A replica that crashes mid-request: its request and its abort both fail."""

    def __init__(self) -> None:
        self.sent = []

    async def async_generate(self, rid=None, sampling_params=None, **_):
        self.sent.append(rid)
        await asyncio.sleep(0.2)
        raise EngineUnreachable("http://a/generate: no answer (Server disconnected)")

    async def async_abort_request(self, rid=None, abort_all=False):
        raise EngineUnreachable("http://a/abort_request: connection refused")


def test_a_tail_group_aborted_by_the_batch_is_not_retried_elsewhere():
    """keep_groups reached while a tail group's engine dies (its abort fails too): the group must
    not be sent again to a live engine, where nobody would abort it and the step would wait for
    its whole generation (the long tail over-sampling cuts)."""
    dying, live = _Dying(), _Engine(hold=True)
    manager = RolloutManager([dying, live])
    prompts = _prompts(2)

    def place(prompt, weight=1, exclude=()):  # group 0 on the live engine, group 1 on the dying one
        engine = 1 if prompt == prompts[0] else 0
        if engine in exclude:
            engine = 1 - engine
        manager.router.load[engine] += weight
        return engine

    manager.router.pick = place
    first = asyncio.Event()
    real = live.async_generate

    async def finish_group_0(rid=None, sampling_params=None, **kw):
        if rid.endswith("-0"):
            live.sent.append(rid)
            first.set()
            return [_output()] * sampling_params["n"]
        return await real(rid=rid, sampling_params=sampling_params, **kw)

    live.async_generate = finish_group_0
    groups = _run(manager.agenerate(prompts, PARAMS, n=1, keep_groups=1))
    assert len(groups) == 1 and groups[0][0].group == 0
    assert [rid for rid in live.sent if not rid.endswith("-0")] == []  # group 1 never went to the live one
