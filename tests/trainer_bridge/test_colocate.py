"""colocated_step over in-process engines (CPU: release/resume are logged no-ops).

Oracles: the recorded order of the engine calls (the choreography), the trainer's Policy (the
engine's rollout logprobs after the step equal its recomputation bit for bit, deterministic mode)
and the engine's own output before a failed step (unchanged)."""

from __future__ import annotations

import pytest
import torch

from trainer_bridge.colocate import ColocateError, colocated_step
from trainer_bridge.sync import push_weights

ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "enable_deterministic_inference": True}
SAMPLED = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 800, 9, 77]]


class Wrapped:
    """An engine seen through a stand-in client: every method is the engine's unless overridden."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


class RecordingClient(Wrapped):
    """Records the choreography's verbs as they reach the engine."""

    def __init__(self, engine, calls: list) -> None:
        super().__init__(engine)
        self.calls = calls

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))
        return self.engine.resume_memory_occupation(tags)

    def pause_generation(self, mode="abort"):
        self.calls.append(("pause", mode))
        self.engine.pause_generation(mode)

    def update_weights_from_tensor(self, *args, **kwargs):
        self.calls.append(("update", kwargs.get("weight_version")))
        return self.engine.update_weights_from_tensor(*args, **kwargs)

    def continue_generation(self):
        self.calls.append(("continue",))
        self.engine.continue_generation()


@pytest.fixture(scope="module")
def model_path() -> str:
    from engine.testing.tiny_model import tiny_model_path

    return str(tiny_model_path())


@pytest.fixture()
def engine(model_path):
    from engine import Engine

    eng = Engine(model_path=model_path, **ENGINE_KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture()
def trainer(model_path):
    from trainer_bridge.losses import LossConfig
    from trainer_bridge.policy import Policy
    from trainer_bridge.trainer import TorchTrainer

    return TorchTrainer(Policy.from_pretrained(model_path), LossConfig())


def _train_step(trainer, samples):
    from trainer_bridge.rollout_batch import RolloutBatch

    advantages = [1.0 if s.index == 0 else -1.0 for s in samples]
    return lambda: trainer.train_step(RolloutBatch.from_samples(samples, advantages), lr=1e-2)


def _rollouts(client):
    from rollout.manager import RolloutManager

    return [s for g in RolloutManager([client]).generate(PROMPTS, SAMPLED, n=2) for s in g]


def test_the_step_releases_trains_resumes_weights_pushes_then_resumes_kv(engine, trainer):
    calls: list = []
    client = RecordingClient(engine, calls)
    samples = _rollouts(client)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    calls.clear()
    train = _train_step(trainer, samples)

    def recorded_train_step():
        calls.append(("train",))
        return train()

    push = lambda: push_weights(client, trainer.policy.model.named_parameters(), "step-1",  # noqa: E731
                                bucket_bytes=64 << 10)
    metrics, phases = colocated_step([client], recorded_train_step, push)
    verbs = [c for c in calls if c[0] != "update"]
    assert verbs == [("release", None), ("train",), ("resume", ("weights", "cuda_graph")), ("pause", "retract"),
                     ("continue",), ("resume", ("kv_cache",))]
    updates = [c[1] for c in calls if c[0] == "update"]
    assert len(updates) > 1 and updates[-1] == "step-1" and set(updates[:-1]) == {None}  # several buckets
    assert metrics["grad_norm"] > 0 and all(v >= 0 for v in phases.as_dict().values())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    info = engine.get_server_info()["internal_states"][0]
    assert info["memory_released"] == [] and not info["paused"] and engine.get_weight_version() == "step-1"
    after = _rollouts(client)  # on the pushed weights, bit for bit what the trainer computes
    assert all(s.weight_versions == ["step-1"] * 6 for s in after)
    with torch.no_grad():
        lps = trainer.policy.rollout_logprobs([s.prompt_ids for s in after], [s.response_ids for s in after])
    for s, lp in zip(after, lps):
        assert torch.equal(torch.tensor(s.rollout_logprobs), lp.float())
    engine.check_integrity()


def test_a_failed_train_step_still_resumes_every_engine(engine, model_path):
    from engine import Engine

    second = Engine(model_path=model_path, **ENGINE_KWARGS)
    try:
        clients = [engine, second]
        before = [c.generate(input_ids=PROMPTS, sampling_params={**SAMPLED, "temperature": 0.0}) for c in clients]

        def diverged():
            raise FloatingPointError("the RL loss is nan")

        with pytest.raises(FloatingPointError, match="nan"):
            colocated_step(clients, diverged, lambda: None)
        for client, outs in zip(clients, before):
            info = client.get_server_info()["internal_states"][0]
            assert info["memory_released"] == [] and not info["paused"]
            assert client.get_weight_version() == "default"
            again = client.generate(input_ids=PROMPTS, sampling_params={**SAMPLED, "temperature": 0.0})
            assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    finally:
        second.shutdown()


def test_a_refused_push_raises_and_the_engine_is_resumed_and_serving(engine):
    from trainer_bridge.sync import WeightSyncError

    client = engine
    with pytest.raises(WeightSyncError, match="unknown weight 'model.nope.weight'"):
        colocated_step([client], lambda: None, lambda: push_weights(client, [("model.nope.weight", torch.ones(2))], "never"))
    info = engine.get_server_info()["internal_states"][0]
    assert info["memory_released"] == [] and not info["paused"] and engine.get_weight_version() == "default"
    assert len(client.generate(input_ids=PROMPTS[0], sampling_params=SAMPLED)["output_ids"]) == 6


def test_a_refused_release_is_reported_and_nothing_is_left_released(engine):
    class Refusing(Wrapped):
        def release_memory_occupation(self, tags=None):
            return False, "requests are running"

    with pytest.raises(ColocateError, match="refused to release memory all: requests are running"):
        colocated_step([Refusing(engine)], lambda: None, lambda: None)
    assert engine.get_server_info()["internal_states"][0]["memory_released"] == []
    with pytest.raises(ValueError, match="at least one engine"):
        colocated_step([], lambda: None, lambda: None)


def test_keep_cuda_graphs_releases_weights_and_kv_only(engine, trainer):
    calls: list = []
    client = RecordingClient(engine, calls)
    samples = _rollouts(client)
    calls.clear()
    push = lambda: push_weights(client, trainer.policy.model.named_parameters(), "kept",  # noqa: E731
                                bucket_bytes=64 << 10)
    colocated_step([client], _train_step(trainer, samples), push, keep_cuda_graphs=True)
    memory = [c for c in calls if c[0] in ("release", "resume")]
    assert memory == [("release", ["weights", "kv_cache"]), ("resume", ("weights",)), ("resume", ("kv_cache",))]
    info = engine.get_server_info()["internal_states"][0]
    assert info["memory_released"] == [] and not info["paused"] and engine.get_weight_version() == "kept"
    assert all(s.weight_versions == ["kept"] * 6 for s in _rollouts(client))


def test_keep_weights_releases_kv_and_graphs_only(engine, trainer):
    """LoRA RL's step: the frozen base stays resident (a release without a CPU backup would leave
    it undefined, and an adapter push does not rewrite it)."""
    calls: list = []
    client = RecordingClient(engine, calls)
    colocated_step([client], lambda: None, lambda: None, keep_weights=True)
    memory = [c for c in calls if c[0] in ("release", "resume")]
    assert memory == [("release", ["cuda_graph", "kv_cache"]), ("resume", ("cuda_graph",)), ("resume", ("kv_cache",))]
    calls.clear()
    colocated_step([client], lambda: None, lambda: None, keep_cuda_graphs=True, keep_weights=True)
    assert [c for c in calls if c[0] in ("release", "resume")] == [("release", ["kv_cache"]), ("resume", ("kv_cache",))]
    assert engine.get_server_info()["internal_states"][0]["memory_released"] == []


@pytest.mark.parametrize("free_after_train_gib,returned", [(60, False), (49.5, True), (None, True)])
def test_cached_memory_goes_back_only_when_the_resume_needs_it(monkeypatch, free_after_train_gib, returned):
    """The engines' release freed 49 GiB: with 60 GiB free after the train step the trainer keeps
    its cached blocks (the next step reuses them, no cudaMalloc); with 49.5 GiB (under 49 + the 8 GiB
    margin), or where nothing was measured, they go back to the driver."""
    import torch

    from trainer_bridge import colocate

    gib = 1 << 30
    free = iter([10 * gib, 59 * gib] if free_after_train_gib is not None else [None, None])
    monkeypatch.setattr(colocate, "_free_device_bytes", lambda: next(free))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    lent = colocate.LentMemory()
    with lent.measure():
        pass
    assert lent.bytes == (49 * gib if free_after_train_gib is not None else None)
    monkeypatch.setattr(colocate, "_free_device_bytes",
                        lambda: None if free_after_train_gib is None else int(free_after_train_gib * gib))
    lent.return_cache_if_needed()
    assert emptied == ([True] if returned else [])


def test_a_refused_resume_is_tried_again_with_the_cache_returned(monkeypatch):
    """An engine that cannot resume beside the trainer's kept cache gets it back and is asked
    again; a second refusal is the error."""
    import torch

    from trainer_bridge import colocate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    class Engine:
        def __init__(self, answers):
            self.answers = list(answers)

        def resume_memory_occupation(self, tags):
            return self.answers.pop(0)

    colocate._resume(Engine([(False, "out of memory"), (True, "")]), ["kv_cache"])
    assert emptied == [True]
    with pytest.raises(colocate.ColocateError, match="out of memory"):
        colocate._resume(Engine([(False, "out of memory"), (False, "out of memory")]), ["kv_cache"])
