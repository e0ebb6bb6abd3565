"""RolloutManager over two CPU engines on the tiny model."""

from __future__ import annotations

import pytest

from rollout.manager import RolloutManager
from rollout.rewards import exact_match, load_reward
from rollout.types import Sample

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


def test_prompts_sharing_a_prefix_meet_on_one_engine(engines):
    manager = RolloutManager(engines, route_prefix=8)
    shared = list(range(10, 18))
    assert len({manager.route(shared + [100 + i]) for i in range(20)}) == 1
    assert len({manager.route([200 + i] + shared) for i in range(20)}) == 2  # both engines get work
    with pytest.raises(ValueError, match="at least one engine"):
        RolloutManager([])


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


def test_rewards_by_dotted_path():
    assert load_reward("rollout.rewards:exact_match") is exact_match
    assert load_reward("rollout.rewards.exact_match") is exact_match
    sample = Sample(0, 0, [1], [2], [-0.1], ["v"], "completed", text=" 42 ", label=42)
    assert exact_match(sample) == 1.0
    for bad, needle in [("nope_module:f", "cannot import"), ("rollout.rewards:nope", "no callable"), ("x", "use")]:
        with pytest.raises(ValueError, match=needle):
            load_reward(bad)


def test_manager_over_a_ray_engine_actor_and_an_in_process_engine(engine_actor, oracle_a):
    """Any EngineClients, mixed: samples equal those of in-process engines on the same checkpoint
    (same seeds: the manager's rids and the requests' sampling seeds do not depend on the engine)."""
    pytest.importorskip("ray")
    from rollout.client import InProcessClient
    from rollout.ray_client import RayClient

    seeded = [dict(SAMPLED, sampling_seed=100 + g) for g in range(6)]
    prompts = _prompts(6)
    mixed = RolloutManager([RayClient(engine_actor), InProcessClient(oracle_a)])
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
