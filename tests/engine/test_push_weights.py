"""trainer_bridge.sync.push_weights over each transport, on the CPU engine.

Oracles: an engine started on the pushed checkpoint (tokens), and the trainer's own Policy: after
a push of the Policy's (changed) parameters, the deterministic engine's rollout logprobs equal the
Policy's recomputation bit for bit ("true on-policy" across a weight update).
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.api.generate_request import GenerateRequest
from tests.engine.conftest import random_prompts
from trainer_bridge.sync import WeightSyncError, push_weights
from engine.models.parallel_state import free_port

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _named(model_dir: str) -> list:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return [kv for path in safetensors_files(model_dir) for kv in load_file(path).items()]


def _ids(eng, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]


def _trainer_group(eng, name: str):
    """This test process as rank 0 of a gloo group the engine joins as rank 1."""
    from weight_sync.nccl import WeightGroup

    port = free_port()
    joined: list = []
    engine_side = threading.Thread(target=lambda: joined.append(
        eng.init_weights_update_group("127.0.0.1", port, 1, 2, name, backend="gloo")))
    engine_side.start()
    group = WeightGroup("127.0.0.1", port, 0, 2, name, backend="gloo", timeout_s=60)
    engine_side.join()
    assert joined[0][0], joined[0][1]
    return group


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_push_equals_an_engine_on_the_pushed_weights(engine_factory, other_model_dir, other_engine, transport):
    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=8)
    group = _trainer_group(eng, "push") if transport == "distributed" else None
    push_weights(eng, _named(other_model_dir), "v-" + transport, transport=transport,
                 bucket_bytes=64 << 10, group=group, group_name="push")  # many buckets
    assert _ids(eng, prompts) == _ids(other_engine, prompts)
    assert eng.get_weight_version() == "v-" + transport and not eng.local_core.paused
    eng.check_integrity()
    if group is not None:  # both ends, while both are alive
        assert eng.destroy_weights_update_group("push")[0]
        group.destroy()


def test_a_refused_bucket_raises_and_leaves_the_engine_serving(engine_factory, other_model_dir):
    eng = engine_factory()
    named = _named(other_model_dir)
    named.insert(len(named) // 2, ("model.layers.0.mlp.nope.weight", torch.ones(2)))
    with pytest.raises(WeightSyncError, match="unknown weight 'model.layers.0.mlp.nope.weight'"):
        push_weights(eng, named, "never", bucket_bytes=64 << 10)
    assert not eng.local_core.paused and eng.get_weight_version() == "default"
    assert len(_ids(eng, [[5, 6, 7]])[0]) == 8
    with pytest.raises(ValueError, match="needs group"):
        push_weights(eng, named, "v", transport="distributed")
    eng.check_integrity()


def test_policy_to_engine_push_keeps_rollouts_on_policy(engine_factory, tiny_model_dir):
    from trainer_bridge.policy import Policy

    eng = engine_factory(enable_deterministic_inference=True)
    policy = Policy.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a training step's worth of change
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    push_weights(eng, policy.model.named_parameters(), "step-1", bucket_bytes=256 << 10)
    prompts = random_prompts(3, eng.local_core.parts.vocab_size, lengths=(5, 90), seed=9)
    params = [{"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 7 + i}
              for i in range(len(prompts))]
    outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert all(o["meta_info"]["weight_versions"] == [{"version": "step-1", "start": 0, "end": 12}] for o in outs)
    engine_lps = [torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    with torch.no_grad():
        policy_lps = policy.rollout_logprobs(prompts, [o["output_ids"] for o in outs])
    for a, b in zip(engine_lps, policy_lps):
        assert torch.equal(a, b.float()), (a - b).abs().max()


def test_in_place_push_keeps_running_requests_and_sets_the_version(engine_factory, other_model_dir):
    import asyncio

    eng = engine_factory()
    params = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}

    async def run() -> dict:  # the push lands while this request is decoding
        last, pushed = None, False
        async for chunk in eng.async_generate(input_ids=[5, 6, 7, 8], sampling_params=params, stream=True):
            last = chunk
            if not pushed and len(chunk["output_ids"]) >= 3:
                pushed = True
                await asyncio.to_thread(push_weights, eng, _named(other_model_dir), "in-place-1",
                                        pause_mode="in_place")
        return last

    final = asyncio.run(run())
    assert len(final["output_ids"]) == 200 and [s["version"] for s in final["meta_info"]["weight_versions"]] \
        == ["default", "in-place-1"]
    assert eng.get_weight_version() == "in-place-1" and not eng.local_core.paused
    eng.check_integrity()


def test_a_failed_pause_or_drain_never_leaves_the_engine_paused(engine_factory, other_model_dir, monkeypatch):
    from engine.runner.pending_result import PendingResult

    eng = engine_factory()
    eng.local_core.overlap = True  # the pause finds a launched batch, and reading it back fails

    def lost(self):
        raise RuntimeError("device lost")

    answers: list = []
    (req,), _ = eng.builder.build(GenerateRequest(input_ids=[5, 6, 7], sampling_params=GREEDY))
    with eng._lock:
        eng._sinks[req.rid] = answers.append
    eng._call(lambda core: (core.handle(req), core.step()))
    monkeypatch.setattr(PendingResult, "resolve", lost)
    push_weights(eng, _named(other_model_dir), "after-failure")
    monkeypatch.undo()
    assert [a.output["meta_info"]["finish_reason"]["type"] for a in answers] == ["abort"]
    assert eng.get_weight_version() == "after-failure" and not eng.local_core.paused
    with pytest.raises(ValueError, match="pause mode"):
        push_weights(eng, _named(other_model_dir), "x", pause_mode="later")
    assert not eng.local_core.paused
    eng.check_integrity()
