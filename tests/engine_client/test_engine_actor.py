"""The Ray engine actor through RayClient, and a trainer actor pushing its Policy into it (CPU).

Oracles: in-process engines started on each checkpoint (greedy tokens), the trainer's Policy
(rollout logprobs, bit for bit in the deterministic mode), and the actor's own output before a
refused update (unchanged)."""

from __future__ import annotations

import asyncio
import os
import pickle
import time

import pytest
import torch

from tests.rl_setup import ENGINE_KWARGS, GREEDY, PROMPTS, greedy_ids

pytest.importorskip("ray")


def _named(model_dir: str) -> list:
    from safetensors.torch import load_file

    return list(load_file(f"{model_dir}/model.safetensors").items())


@pytest.fixture(scope="module")
def trainer_b(ray_cluster, colocation, model_b):
    """A trainer actor holding a Policy on checkpoint B, in the engine actor's bundle."""
    from trainer_bridge.trainer_actor import start_trainer_actor

    actor = start_trainer_actor(model_b, placement_group=colocation, bundle_index=0)
    yield actor
    ray_cluster.kill(actor)


def _restore(client, model_a: str) -> None:
    ok, message, _ = client.update_weights_from_disk(model_a, weight_version="default")
    assert ok, message


def test_generate_through_the_actor_equals_an_in_process_engine(engine_actor, oracle_a):
    from engine_client.ray_client import RayClient

    client = RayClient(engine_actor)
    assert greedy_ids(client) == greedy_ids(oracle_a)

    async def concurrent() -> list:  # many generates in flight in the async actor at once
        return await asyncio.gather(*[client.async_generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
                                      for p in PROMPTS * 3])

    outs = asyncio.run(concurrent())
    assert [o["output_ids"] for o in outs] == greedy_ids(oracle_a) * 3
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 8 for o in outs)
    processed = client.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True,
                                logprob_distribution="processed")
    assert processed["meta_info"]["logprob_distribution"] == "processed"
    asked = dict(input_ids=[5, 6, 7], sampling_params=GREEDY, return_logprob=True, token_ids_logprob=[9, 4])
    want = oracle_a.generate(**asked)["meta_info"]["output_token_ids_logprobs"]
    assert client.generate(**asked)["meta_info"]["output_token_ids_logprobs"] == want and len(want) == 8
    assert asyncio.run(client.async_generate(**asked))["meta_info"]["output_token_ids_logprobs"] == want
    assert client.health() and client.get_weight_version() == "default"
    info = client.get_server_info()
    assert info["weight_version"] == "default" and info["internal_states"][0]["num_running_reqs"] == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": -1})
    assert client.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"] == greedy_ids(oracle_a)[0]


@pytest.mark.parametrize("transport,tensor_transport", [("tensor", "ray"), ("tensor", "ipc"), ("disk", "auto")])
def test_trainer_actor_push_equals_an_engine_on_the_new_checkpoint(engine_actor, trainer_b, ray_cluster, model_a,
                                                                   oracle_a, oracle_b, transport, tensor_transport):
    """Shared memory (Ray's object store, or cuda_ipc's shared-memory descriptors) and disk."""
    from rollout.manager import RolloutManager
    from engine_client.ray_client import RayClient
    from trainer_bridge.colocate import PushConfig

    client = RayClient(engine_actor)
    try:
        push = PushConfig(transport=transport, bucket_bytes=64 << 10)  # several buckets
        seconds = ray_cluster.get(trainer_b.push_weights.remote([engine_actor], f"b-{transport}", push,
                                                                tensor_transport))
        assert seconds > 0
        assert greedy_ids(client) == greedy_ids(oracle_b) != greedy_ids(oracle_a)
        samples = RolloutManager([client]).generate(PROMPTS, GREEDY, n=2)
        assert all(s.weight_versions == [f"b-{transport}"] * 8 for group in samples for s in group)
        client.check_integrity()  # any Engine method, forwarded by name
    finally:
        _restore(client, model_a)
    assert greedy_ids(client) == greedy_ids(oracle_a)


def test_weight_version_advances_in_samples_across_pushes(engine_actor, model_a, model_b):
    from rollout.manager import RolloutManager
    from engine_client.ray_client import RayClient
    from trainer_bridge.sync import push_weights

    client = RayClient(engine_actor)
    manager = RolloutManager([client])
    try:
        seen = []
        for step, model in enumerate([model_b, model_a, model_b], start=1):
            push_weights(client, _named(model), f"step-{step}")
            groups = manager.generate(PROMPTS[:2], GREEDY, n=2)
            seen.append({v for group in groups for s in group for v in s.weight_versions})
        assert seen == [{"step-1"}, {"step-2"}, {"step-3"}]
    finally:
        _restore(client, model_a)


def test_one_object_store_copy_of_the_weights_reaches_an_engine_by_reference(engine_actor, ray_cluster, model_a,
                                                                          model_b, oracle_b):
    from engine_client.ray_client import RayClient

    client = RayClient(engine_actor)
    ref = ray_cluster.put(_named(model_b))  # what a trainer does once for several engines
    try:
        ok, message = client.update_weights_from_tensor(ref, weight_version="by-ref")
        assert ok, message
        assert greedy_ids(client) == greedy_ids(oracle_b) and client.get_weight_version() == "by-ref"
    finally:
        _restore(client, model_a)


def test_bad_payloads_are_refused_with_the_reason_and_the_old_weights_keep_serving(engine_actor, model_a,
                                                                                    oracle_a):
    from engine_client.ray_client import RayClient
    from trainer_bridge.sync import WeightSyncError, push_weights
    from weight_sync.bucket import FlattenedBucket
    from weight_sync.cuda_ipc import serialize

    client = RayClient(engine_actor, tensor_transport="ipc")
    before = greedy_ids(client)
    named = dict(_named(model_a))
    embed = "model.embed_tokens.weight"
    bad_shape = [(embed, torch.zeros(7, 3))]
    cases = [
        ([("model.layers.0.mlp.nope.weight", torch.ones(2))], None, "unknown weight 'model.layers.0.mlp.nope.weight'"),
        (bad_shape, None, embed),
        (FlattenedBucket.pack(bad_shape).to_payload(), "flattened_bucket", embed),
        (pickle.dumps(os.system), None, "system"),  # a function the allowlist does not name (not print: Ray patches it)
        (serialize([(embed, named[embed])]), "bogus_format", "load_format 'bogus_format'"),
        (b"not a pickle", None, "could not be read"),
    ]
    for payload, load_format, needle in cases:
        ok, message = client.update_weights_from_tensor(payload, load_format=load_format, weight_version="never")
        assert not ok and needle in message, message
    with pytest.raises(WeightSyncError, match="unknown weight"):
        push_weights(client, [("lm_head.nope", torch.ones(3))], "never")
    ok, message, _ = client.update_weights_from_disk("/nonexistent/checkpoint", weight_version="never")
    assert not ok and "/nonexistent/checkpoint" in message
    # a ValueError from Engine comes back as a refusal of sglang.Engine's shape: (False, message, 0)
    ok, message, paused = client.update_weights_from_disk("/nonexistent/checkpoint", load_format="pt")
    assert not ok and paused == 0 and "load_format 'pt'" in message, message
    assert client.get_weight_version() == "default"
    assert greedy_ids(client) == before == greedy_ids(oracle_a)
    assert not client.get_server_info()["internal_states"][0]["paused"]


def test_release_and_resume_round_trip(engine_actor, oracle_a):
    from engine_client.ray_client import RayClient

    client = RayClient(engine_actor)
    ok, message = client.release_memory_occupation()
    assert ok, message
    assert sorted(client.get_server_info()["internal_states"][0]["memory_released"]) == \
        ["cuda_graph", "kv_cache", "weights"]
    for tags in (["weights", "cuda_graph"], ["kv_cache"]):  # weights first, KV last
        ok, message = client.resume_memory_occupation(tags)
        assert ok, message
    assert client.get_server_info()["internal_states"][0]["memory_released"] == []
    assert greedy_ids(client) == greedy_ids(oracle_a)
    ok, message = client.release_memory_occupation(["bogus"])
    assert not ok and "unknown memory tag 'bogus'" in message


def test_the_actor_serves_sglang_routes_over_http(engine_actor, ray_cluster, model_a, model_b, oracle_b):
    from engine_client.client import HttpClient

    url = ray_cluster.get(engine_actor.serve_http.remote())
    http = HttpClient(url)
    try:
        assert http.health() and http.get_weight_version() == "default"
        ok, message, _ = http.update_weights_from_disk(model_b, weight_version="http-b")
        assert ok, message
        assert greedy_ids(http) == greedy_ids(oracle_b) and http.get_weight_version() == "http-b"
    finally:
        _restore(http, model_a)
        http.close()
    with pytest.raises(Exception, match="already serves HTTP"):
        ray_cluster.get(engine_actor.serve_http.remote())


def test_colocated_step_across_actors_keeps_rollouts_on_policy(engine_actor, trainer_b, ray_cluster, model_a):
    """Engine generates -> the trainer actor releases it, trains, pushes, resumes it -> the engine's
    rollout logprobs equal the trainer's recomputation bit for bit. Runs after the push tests:
    it trains trainer_b away from checkpoint B."""
    from rollout.manager import RolloutManager
    from engine_client.ray_client import RayClient
    from trainer_bridge.colocate import PushConfig

    client = RayClient(engine_actor)
    sampled = {**GREEDY, "temperature": 1.0}
    try:
        samples = [s for g in RolloutManager([client]).generate(PROMPTS, sampled, n=2) for s in g]
        advantages = [1.0 if s.index == 0 else -1.0 for s in samples]
        metrics, phases = ray_cluster.get(trainer_b.colocated_step.remote(
            [engine_actor], samples, advantages, 1e-2, "step-1", PushConfig(bucket_bytes=64 << 10), "ray"))
        assert metrics["grad_norm"] > 0 and set(phases) == {"release", "train", "return_cache", "resume_weights", "push", "resume_kv"}
        info = client.get_server_info()["internal_states"][0]
        assert info["memory_released"] == [] and not info["paused"]
        after = [s for g in RolloutManager([client]).generate(PROMPTS, sampled, n=2) for s in g]
        assert all(s.weight_versions == ["step-1"] * 8 for s in after)
        trainer_lps = ray_cluster.get(trainer_b.rollout_logprobs.remote([s.prompt_ids for s in after],
                                                                        [s.response_ids for s in after]))
        assert [s.rollout_logprobs for s in after] == trainer_lps
    finally:
        _restore(client, model_a)


def test_a_method_added_to_engine_reaches_ray_callers_with_no_edit_in_the_client_or_actor(ray_cluster, model_a):
    """An Engine subclass adds methods (sync, async, a (success, message) one); RayClient and the
    actor, untouched, forward them; a name the engine lacks is an AttributeError."""
    from engine import Engine
    from engine_client.engine_actor import start_engine_actors
    from engine_client.ray_client import RayClient

    class Extended(Engine):
        def versions_joined(self, times: int, sep: str = "/") -> str:
            return sep.join([self.get_weight_version()] * times)

        async def async_prompt_tokens(self, input_ids: list) -> int:
            out = await self.async_generate(input_ids=input_ids, sampling_params={"max_new_tokens": 1})
            return out["meta_info"]["prompt_tokens"]

        def refuse(self, why: str) -> tuple[bool, str]:
            raise ValueError(why)

    (actor,) = start_engine_actors(1, {"model_path": model_a, **ENGINE_KWARGS}, engine_class=Extended)
    client = RayClient(actor, owns=True)
    try:
        assert client.versions_joined(2, sep="+") == "default+default"
        assert asyncio.run(client.async_prompt_tokens([5, 6, 7])) == 3
        assert client.refuse("no thanks") == (False, "no thanks")
        with pytest.raises(AttributeError, match="no public method 'nope'"):
            client.nope()
        with pytest.raises(AttributeError):
            client._private()
    finally:
        client.close()


def test_start_engine_actors_refuses_zero():
    from engine_client.engine_actor import start_engine_actors

    with pytest.raises(ValueError, match="n >= 1"):
        start_engine_actors(0, dict(ENGINE_KWARGS))


def test_an_actor_the_cluster_cannot_place_times_out_with_a_clear_error(ray_cluster, model_a):
    from engine_client.engine_actor import start_engine_actors

    with pytest.raises(TimeoutError, match="num_gpus=64.*resources"):
        start_engine_actors(1, {"model_path": model_a, **ENGINE_KWARGS}, num_gpus=64, start_timeout_s=1)


def test_an_engine_actor_that_fails_to_start_raises_its_own_error(ray_cluster, model_a):
    """In-process the Engine raises ValueError; through Ray it was an ActorDiedError whose message is
    the remote traceback (the CLI printed it all). Now the same ValueError, Ray's error its cause."""
    from engine_client.engine_actor import start_engine_actors

    with pytest.raises(ValueError) as exc:
        start_engine_actors(1, {"model_path": model_a, **ENGINE_KWARGS, "tp_size": 3})
    assert str(exc.value) == "tp_size 3 must divide num_attention_heads 4"
    assert isinstance(exc.value.__cause__, ray_cluster.exceptions.RayActorError)


def test_a_dead_engine_actor_reads_unhealthy_and_its_calls_raise(ray_cluster):
    from engine_client.ray_client import EngineDied, RayClient

    @ray_cluster.remote(num_cpus=0)
    class Stub:  # answers like an engine actor until killed
        async def call(self, method: str, *args, **kwargs):
            return True if method == "health" else {"output_ids": [1]}

        async def shutdown(self) -> None:
            pass

    client = RayClient(Stub.remote())
    assert client.health() and client.generate(input_ids=[5]) == {"output_ids": [1]}
    ray_cluster.kill(client.actor)  # takes effect asynchronously: a call may still get in first
    deadline = time.monotonic() + 30
    while client.health() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.health()
    with pytest.raises(EngineDied) as exc:  # one line (an OSError: the CLI prints it), Ray's error as the cause
        client.generate(input_ids=[5])
    assert str(exc.value).startswith(f"engine actor {client.actor._actor_id.hex()[:8]} died: ")
    assert "\n" not in str(exc.value) and isinstance(exc.value.__cause__, ray_cluster.exceptions.RayActorError)
    with pytest.raises(EngineDied):
        asyncio.run(client.async_generate(input_ids=[5]))
    RayClient(client.actor, owns=True).close()  # a dead engine closes quietly
    with pytest.raises(ValueError, match="tensor_transport"):
        RayClient(client.actor, tensor_transport="pigeon")


def test_a_colocation_group_the_cluster_cannot_reserve_times_out_with_a_clear_error(ray_cluster):
    from engine_client.engine_actor import colocation_group

    too_many = int(ray_cluster.cluster_resources().get("GPU", 0)) + 1  # none on a CPU box; one more than a GPU box has
    with pytest.raises(TimeoutError, match=f"'GPU': {too_many}.*could not be reserved"):
        colocation_group(1, gpus_per_bundle=too_many, timeout_s=1)
