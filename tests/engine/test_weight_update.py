"""Weight updates and pause/continue on the CPU engine (engine/generation_control.py).

Oracle: an engine started on the new checkpoint. A request that spans an update must equal, token
for token, old-weights decoding up to the update and then the new weights' continuation of
prompt + those tokens; bad payloads change nothing and leave the engine serving.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

from engine.api.generate_request import GenerateRequest
from tests.engine.conftest import random_prompts

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}


def _named_tensors(model_dir: str) -> list:
    from safetensors.torch import load_file

    from engine.models.loader import safetensors_files

    return [item for path in safetensors_files(model_dir) for item in load_file(path).items()]


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_update_from_tensor_equals_an_engine_started_on_those_weights(engine_factory, other_model_dir,
                                                                      other_engine):
    eng = engine_factory()
    prompts = random_prompts(3, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=1)
    before = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    ok, message = eng.update_weights_from_tensor(_named_tensors(other_model_dir), weight_version="v1")
    assert ok and message == "Success. Weight version updated to v1.", message
    after = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert _ids(after) == _ids(other_engine.generate(input_ids=prompts, sampling_params=GREEDY))
    assert _ids(after) != _ids(before)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in after)  # the stale cache was flushed
    assert after[0]["meta_info"]["weight_version"] == "v1" == eng.get_weight_version()
    assert after[0]["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 8}]
    assert before[0]["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    eng.check_integrity()


def test_bad_payloads_change_nothing_and_name_the_problem(engine_factory, other_model_dir):
    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=2)
    before = _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY))
    good = _named_tensors(other_model_dir)
    name, tensor = good[0]
    cases = {
        "unknown weight 'model.layers.0.mlp.nope.weight'": good[:3] + [("model.layers.0.mlp.nope.weight", tensor)],
        f"weight {name!r} has shape": good[:3] + [(name, tensor[:1])],
    }
    for expected, payload in cases.items():
        ok, message = eng.update_weights_from_tensor(payload, weight_version="bad")
        assert not ok and expected in message and message.startswith("Weights not updated"), message
    with pytest.raises(ValueError, match="'safetensors' is not supported"):
        eng.update_weights_from_tensor(good, load_format="safetensors")
    with pytest.raises(ValueError, match="flattened_tensor"):
        eng.update_weights_from_tensor(good, load_format="flattened_bucket")
    with pytest.raises(ValueError, match=r"\(name, tensor\) pairs"):
        eng.update_weights_from_tensor([tensor])
    assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY)) == before  # untouched, serving
    assert eng.get_weight_version() == "default" and not eng.local_core.paused
    eng.check_integrity()


def test_update_from_flattened_buckets(engine_factory, other_model_dir, other_engine):
    from weight_sync.bucket import FlattenedBucket

    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=6)
    named = _named_tensors(other_model_dir)
    eng.pause_generation("retract")
    for i in range(0, len(named), 7):  # buckets of 7 tensors, mixed dtypes allowed
        payload = FlattenedBucket.pack(named[i:i + 7]).to_payload()
        ok, message = eng.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                     flush_cache=False)
        assert ok, message
    assert eng.flush_cache()
    eng.continue_generation()
    expected = _ids(other_engine.generate(input_ids=prompts, sampling_params=GREEDY))
    assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY)) == expected
    eng.check_integrity()


def test_update_from_disk_checks_the_whole_checkpoint_first(engine_factory, other_model_dir, other_engine,
                                                            tmp_path):
    from safetensors.torch import save_file

    eng = engine_factory()
    prompts = random_prompts(2, eng.local_core.parts.vocab_size, lengths=(5, 40), seed=3)
    before = _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY))
    partial = tmp_path / "partial"
    shutil.copytree(other_model_dir, partial, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = dict(_named_tensors(other_model_dir))
    dropped = "model.layers.1.mlp.down_proj.weight"
    del tensors[dropped]
    save_file(tensors, str(partial / "model.safetensors"))
    ok, message, _ = eng.update_weights_from_disk(str(partial))
    assert not ok and "missing weights" in message and dropped in message, message
    ok, message, _ = eng.update_weights_from_disk(str(tmp_path / "nowhere"))
    assert not ok and "nowhere" in message, message
    assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY)) == before
    ok, message, _ = eng.update_weights_from_disk(other_model_dir, weight_version="step-2")
    assert ok, message
    expected = _ids(other_engine.generate(input_ids=prompts, sampling_params=GREEDY))
    assert _ids(eng.generate(input_ids=prompts, sampling_params=GREEDY)) == expected
    eng.check_integrity()


def _act_mid_stream(eng, prompt: list[int], action, after_tokens: int = 3) -> dict:
    """Streams one long request; runs `action` (blocking, off the event loop) once it has
    `after_tokens` tokens; returns the final output."""
    async def run() -> dict:
        last, acted = None, False
        async for chunk in eng.async_generate(input_ids=prompt, sampling_params=LONG, stream=True):
            last = chunk
            if not acted and len(chunk["output_ids"]) >= after_tokens:
                acted = True
                await asyncio.to_thread(action)
        return last

    return asyncio.run(run())


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_pause_abort_ends_running_requests_and_queues_new_ones(engine_factory, overlap):
    eng = engine_factory()
    eng.local_core.overlap = overlap  # a launched batch is in flight when the pause arrives: it is drained
    prompt = random_prompts(1, eng.local_core.parts.vocab_size, lengths=(5, 20), seed=4)[0]
    final = _act_mid_stream(eng, prompt, lambda: eng.pause_generation("abort"))
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(final["output_ids"]) < LONG["max_new_tokens"]
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (eng.generate(input_ids=prompt, sampling_params=GREEDY), done.set()))
    waiting.start()
    time.sleep(0.3)
    assert not done.is_set(), "a request ran while the engine was paused"
    eng.continue_generation()
    waiting.join(timeout=30)
    assert done.is_set()
    with pytest.raises(ValueError, match="pause mode must be one of abort, retract, in_place"):
        eng.pause_generation("later")
    eng.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_request_spanning_an_update_switches_weights_at_the_pause(engine_factory, other_model_dir,
                                                                    other_engine, mode, overlap):
    eng = engine_factory()
    eng.local_core.overlap = overlap
    prompt = random_prompts(1, eng.local_core.parts.vocab_size, lengths=(5, 20), seed=5)[0]
    replies = []

    def update() -> None:
        eng.pause_generation(mode)
        # in_place keeps the running request's KV, which a flush would drop: SGLang's tests pass
        # flush_cache=(mode == "retract"); flush_cache=True is refused before writing there
        replies.append(eng.update_weights_from_tensor(_named_tensors(other_model_dir), weight_version="v2",
                                                      flush_cache=mode == "retract"))
        eng.continue_generation()

    final = _act_mid_stream(eng, prompt, update)
    ok, message = replies[0]
    assert ok, message
    out = final["output_ids"]
    assert len(out) == LONG["max_new_tokens"] and final["meta_info"]["finish_reason"]["type"] == "length"
    spans = final["meta_info"]["weight_versions"]
    k = spans[0]["end"]
    assert spans == [{"version": "default", "start": 0, "end": k},
                     {"version": "v2", "start": k, "end": len(out)}] and k >= 3
    assert final["meta_info"]["weight_version"] == "v2"
    if mode == "retract":  # re-prefilled with the new weights: their continuation of prompt + out[:k]
        params = dict(LONG, max_new_tokens=len(out) - k)
        assert out[k:] == other_engine.generate(input_ids=prompt + out[:k], sampling_params=params)["output_ids"]
        assert final["meta_info"]["num_retractions"] == 1
    # in_place: the new weights attend over KV the old ones wrote (SGLang's in_place too), so
    # no engine started on either checkpoint is an oracle for the tokens after k
    eng.check_integrity()


def test_retract_during_a_chunked_prefill_resumes_it(engine_factory):
    """Pause with mode retract while a long prompt is half prefilled (driven step by step on the
    core thread): it goes back to the queue, holds no KV, and finishes as if never paused."""
    import queue

    from engine.core.messages import PauseReq

    eng = engine_factory(chunked_prefill_size=16)
    prompt = random_prompts(1, eng.local_core.parts.vocab_size, lengths=(100, 100), seed=10)[0]
    expected = eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    eng.flush_cache()
    (req,), _ = eng.builder.build(GenerateRequest(input_ids=prompt, sampling_params=GREEDY))
    results: "queue.Queue" = queue.Queue()
    with eng._lock:
        eng._sinks[req.rid] = results.put

    def half_prefill_then_retract(core) -> tuple:
        core.handle(req)
        core.step()  # the first 16-token chunk
        chunked = core.scheduler.chunked_req is not None
        core.handle(PauseReq("retract"))
        return chunked, core.scheduler.chunked_req, [r.rid for r in core.scheduler.waiting]

    was_chunked, chunked_after, waiting = eng._call(half_prefill_then_retract)
    assert was_chunked and chunked_after is None and waiting == [req.rid]
    eng.check_integrity()
    eng.continue_generation()
    final = eng._wait_final(results)
    assert final["output_ids"] == expected and final["meta_info"]["num_retractions"] == 1
    eng.check_integrity()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_an_abort_just_before_a_pause_is_answered_at_the_pause(engine_factory, mode):
    from engine.core.messages import AbortReq
    from engine.core.messages import PauseReq

    eng = engine_factory()
    prompt = random_prompts(1, eng.local_core.parts.vocab_size, lengths=(5, 20), seed=11)[0]
    (req,), _ = eng.builder.build(GenerateRequest(input_ids=prompt, sampling_params=LONG))

    def abort_then_pause(core) -> tuple:
        core.handle(req)
        core.step()
        core.step()
        outputs = core.handle(AbortReq(req.rid)) + core.handle(PauseReq(mode)).outputs
        return outputs, core.scheduler.has_work()

    outputs, has_work = eng._call(abort_then_pause)
    assert [(o.rid, o.finished, o.output["meta_info"]["finish_reason"]["type"]) for o in outputs] == \
        [(req.rid, True, "abort")]
    assert not has_work and eng.flush_cache()  # nothing holds KV: a weight update could flush
    eng.continue_generation()
    eng.check_integrity()


def test_a_failing_update_still_answers_the_drained_batch(engine_factory, monkeypatch):
    """Overlap on: the update arrives while a batch is launched; that batch finishes a request,
    then loading fails. The request's answer still goes out with the failure reply."""
    from engine.core.messages import UpdateWeightsReq
    from weight_sync.tensor import TensorSource

    eng = engine_factory()
    eng.local_core.overlap = True
    one = dict(GREEDY, max_new_tokens=1)
    (req,), _ = eng.builder.build(GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=one))

    def broken(_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.local_core.runner.model, "load_weights", broken)
    answers: list = []
    with eng._lock:
        eng._sinks[req.rid] = answers.append

    def launch_then_update(core):
        core.handle(req)
        core.step()  # launched, not yet read back
        assert core._inflight is not None and not answers
        return core.handle(UpdateWeightsReq(TensorSource([])))  # the Reply: its outputs are delivered

    assert eng._call(launch_then_update) == (
        False, "Weight update failed (weights may be partly written): RuntimeError: device lost")
    assert [(a.rid, a.finished, len(a.output["output_ids"])) for a in answers] == [(req.rid, True, 1)]
    assert not eng.local_core.paused
    eng.check_integrity()


def test_a_non_float_tensor_in_a_later_shard_is_refused_before_any_write(engine_factory, other_model_dir,
                                                                         tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    eng = engine_factory()
    before = _ids(eng.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY))
    tensors = dict(_named_tensors(other_model_dir))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    shards = tmp_path / "sharded"
    shutil.copytree(other_model_dir, shards, ignore=shutil.ignore_patterns("*.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    assert "model.norm.weight" in second
    for file, part in (("a.safetensors", first), ("b.safetensors", second)):
        save_file({n: tensors[n] for n in part}, str(shards / file))
    index = {"weight_map": {n: "a.safetensors" for n in first} | {n: "b.safetensors" for n in second}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    ok, message, _ = eng.update_weights_from_disk(str(shards))
    assert not ok and "'model.norm.weight'" in message and "non-floating dtype I32" in message, message
    assert _ids(eng.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)) == before
    eng.check_integrity()
