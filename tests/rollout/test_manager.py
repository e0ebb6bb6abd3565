"""RolloutManager over two CPU engines on the tiny model, and its routing over counting fake replicas."""

from __future__ import annotations

import asyncio
import math

import pytest

from rollout.manager import RolloutManager
from rollout.router import PrefixRouter
from rollout.rewards import exact_match, load_reward
from rollout.types import Sample
from engine.models.parallel_state import free_port

SAMPLED = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines():
    from engine import Engine
    from engine.testing.tiny_model import tiny_model_path

    path = str(tiny_model_path())
    pair = [Engine(model_path=path, dtype="float32", device="cpu") for _ in range(2)]
    yield pair
    for eng in pair:
        eng.shutdown()


def _prompts(k: int, length: int = 12) -> list[list[int]]:
    return [[3 + (7 * g + j) % 200 for j in range(length)] for g in range(k)]


def test_groups_of_n_samples_with_logprobs_versions_and_rewards(engines):
    manager = RolloutManager(engines, reward_fn=lambda s: float(len(s.response_ids)))
    prompts = _prompts(4)
    groups = manager.generate(prompts, SAMPLED, n=3, labels=list("abcd"))
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    for g, samples in enumerate(groups):
        assert [s.index for s in samples] == [0, 1, 2] and all(s.group == g for s in samples)
        for s in samples:
            assert s.prompt_ids == prompts[g] and s.label == "abcd"[g] and s.reward == 6.0
            assert len(s.response_ids) == len(s.rollout_logprobs) == len(s.weight_versions) == 6
            assert s.status == "truncated" and s.weight_versions == ["default"] * 6 and s.loss_mask == [1] * 6
            assert all(lp <= 0.0 for lp in s.rollout_logprobs)
        assert len({tuple(s.response_ids) for s in samples}) > 1  # distinct seeds per sample
    for eng in engines:
        eng.check_integrity()


class _CountingEngine:
    """Stands in for an engine replica: counts the requests and samples it gets, answers at once."""

    def __init__(self, name: str) -> None:
        self.name, self.requests = name, []

    async def async_generate(self, input_ids=None, sampling_params=None, **_):
        n = sampling_params["n"]
        self.requests.append((tuple(input_ids), n))
        await asyncio.sleep(0)  # the others are dispatched meanwhile, as with a real engine
        return [{"text": self.name, "output_ids": [7], "meta_info": {
            "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]],
            "weight_versions": [{"version": "v", "start": 0, "end": 1}]}} for _ in range(n)]

    async def async_abort_request(self, rid=None, abort_all=False):
        pass


def _fleet(k: int) -> list:
    return [_CountingEngine(f"e{i}") for i in range(k)]


def _check_groups_whole(groups: list, fleet: list, n: int) -> None:
    """Each group: one request carrying all n samples, every sample from that engine."""
    assert all(len({s.text for s in g}) == 1 and len(g) == n for g in groups)
    assert all(count == n for e in fleet for _, count in e.requests)


def test_one_shared_system_prompt_still_spreads_over_the_replicas():
    """Pure prefix hashing would send all 16 groups to one engine; bounded loads split them: the
    prefix's home takes groups up to 1.25x the mean load (10 of 16), the other replica the rest;
    with no slack, an even split."""
    system = list(range(10, 18))
    prompts = [system + [100 + i, 101 + i] for i in range(16)]
    for slack, split in ((0.25, [6, 10]), (0.0, [8, 8])):
        fleet = _fleet(2)
        manager = RolloutManager(fleet, route_prefix=8, balance_slack=slack)
        groups = manager.generate(prompts, SAMPLED, n=4)
        _check_groups_whole(groups, fleet, 4)
        assert sorted(len(e.requests) for e in fleet) == split
        assert len(fleet[manager.route(system)].requests) == split[1]  # the hash's engine is the home
        assert manager.router.load == [0, 0]  # every group released as it finished


def test_unseen_prefixes_go_to_the_least_loaded_engine_when_hashing_is_skewed():
    fleet = _fleet(3)
    manager = RolloutManager(fleet, route_prefix=4)
    candidates = ([g, g + 1, g + 2, g + 3, 9] for g in range(0, 10000, 4))
    skewed = [p for p in candidates if manager.route(p) == 0][:12]  # all hash to engine 0
    groups = manager.generate(skewed, SAMPLED, n=2)
    _check_groups_whole(groups, fleet, 2)
    assert [len(e.requests) for e in fleet] == [4, 4, 4]


def test_prompts_sharing_a_prefix_meet_on_one_engine_while_its_load_allows():
    fleet = _fleet(2)
    manager = RolloutManager(fleet, route_prefix=8)
    shared = list(range(10, 18))
    for i in range(6):  # one group at a time: loads stay even, the prefix stays home
        manager.generate([shared + [100 + i]], SAMPLED, n=3)
    home = manager.route(shared)
    assert [len(e.requests) for e in fleet] == [6 if i == home else 0 for i in range(2)]
    assert len({manager.route([200 + i] + shared) for i in range(20)}) == 2  # other prefixes hash everywhere
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutManager([])


def test_router_bounds_every_engines_load():
    router = PrefixRouter(4, route_prefix=2, slack=0.25)
    keys = [[i % 3, 0] for i in range(40)] + [[i, 1] for i in range(40)]  # three hot prefixes, then cold ones
    for prompt in keys:  # an engine is only filled past (1 + slack) x the mean when it was the least loaded
        before = list(router.load)
        chosen = router.pick(prompt, 4)
        bound = max(math.ceil(1.25 * sum(router.load) / 4), min(before) + 4)
        assert router.load[chosen] <= bound and router.load[chosen] == before[chosen] + 4, (before, chosen)
    assert sum(router.load) == 320 and max(router.load) <= math.ceil(1.25 * 80) + 4
    first = router.pick([0, 0], 4)  # a hot prefix stays on an engine that already holds it
    assert first in router._homes[router.key([0, 0])]


def test_over_sampling_keeps_the_first_groups_and_aborts_the_rest(engines):
    manager = RolloutManager(engines)
    prompts = _prompts(6)
    short, tail = dict(SAMPLED, max_new_tokens=4), dict(SAMPLED, max_new_tokens=4000)
    groups = manager.generate(prompts, [short, tail, short, tail, tail, tail], n=2, keep_groups=2)
    assert [g[0].group for g in groups] == [0, 2]  # the two short ones; the long tail was aborted
    assert all(s.status == "truncated" and len(s.response_ids) == 4 for g in groups for s in g)
    for eng in engines:  # nothing of the tail is still running
        assert not eng.local_core.scheduler.has_work()
        eng.check_integrity()
    with pytest.raises(ValueError, match="keep_groups"):
        manager.generate(prompts, short, keep_groups=7)
    with pytest.raises(ValueError, match="sampling_params"):
        manager.generate(prompts, [short])


def test_a_replica_that_is_down_costs_a_retry_not_the_step(engines):
    """One HttpClient to a server that is gone, one live engine: every group is generated there."""
    from engine_client.http_client import HttpClient

    gone = HttpClient(f"http://127.0.0.1:{free_port()}")  # a port nobody listens on
    manager = RolloutManager([gone, engines[0]])
    groups = manager.generate(_prompts(4), SAMPLED, n=2)
    assert [len(g) for g in groups] == [2] * 4 and all(s.status == "truncated" for g in groups for s in g)
    assert manager.router.load == [0, 0]
    gone.close()
    engines[0].check_integrity()


def test_rewards_by_dotted_path():
    assert load_reward("rollout.rewards:exact_match") is exact_match
    assert load_reward("rollout.rewards.exact_match") is exact_match
    sample = Sample(0, 0, [1], [2], [-0.1], ["v"], "completed", text=" 42 ", label=42)
    assert exact_match(sample) == 1.0
    for bad, needle in [("nope_module:f", "cannot import"), ("rollout.rewards:nope", "no callable"), ("x", "use")]:
        with pytest.raises(ValueError, match=needle):
            load_reward(bad)


def test_manager_over_a_ray_engine_actor_and_an_in_process_engine(engine_actor, oracle_a):
    """Any EngineAPIs, mixed: samples equal those of in-process engines on the same checkpoint
    (same seeds: the manager's rids and the requests' sampling seeds do not depend on the engine)."""
    pytest.importorskip("ray")
    from engine_client.ray_client import RayClient

    seeded = [dict(SAMPLED, sampling_seed=100 + g) for g in range(6)]
    prompts = _prompts(6)
    mixed = RolloutManager([RayClient(engine_actor), oracle_a])
    assert {mixed.route(p) for p in prompts} == {0, 1}  # both kinds get work
    groups = mixed.generate(prompts, seeded, n=2)
    expected = RolloutManager([oracle_a]).generate(prompts, seeded, n=2)
    assert [[s.response_ids for s in g] for g in groups] == [[s.response_ids for s in g] for g in expected]
    assert all(s.rollout_logprobs == e.rollout_logprobs for g, eg in zip(groups, expected) for s, e in zip(g, eg))
    short, tail = dict(SAMPLED, max_new_tokens=4), dict(SAMPLED, max_new_tokens=4000)
    kept = mixed.generate(prompts, [short, tail, short, tail, tail, tail], n=2, keep_groups=2)
    assert [g[0].group for g in kept] == [0, 2]
    info = RayClient(engine_actor).get_server_info()["internal_states"][0]
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0  # the tail was aborted there too
